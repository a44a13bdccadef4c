"""The Ray layer of hetero_exec: a session's placement plan run by segment actors.

``InferenceSession(model, providers, executor="ray", ...)`` reaches it through one lazy
import of `actors.coordinator.RayExecutor`. Modules, in the order data flows:

* ``options``: the session keywords the Ray executor reads (``max_inflight``...);
* ``connect``: join a cluster or start a local Ray;
* ``segment_model``: a segment cut out as ONNX bytes (its nodes and weights only);
* ``reservation``: actor slots, the placement group, start-up and teardown;
* ``segment``: SegmentActor, which compiles its segments where they run;
* ``coordinator``: RayExecutor (dispatch, pipelining, back-pressure, profiles);
* ``request``, ``recovery``, ``remote_errors``: replays after actor faults, and
  typed errors carried back from actors;
* ``transport/``: seam transports (shared memory on one node, object store,
  device-local, msgpack wire) and Ray Compiled Graphs; ``profile``: Chrome traces.

hetero_exec never imports this package except through that one lazy import.
"""
