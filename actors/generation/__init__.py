"""Text generation on ``executor="ray"``: a decoder split at layer boundaries over stage
actors, each holding its layers' cache per sequence group, the decode loop running
between the actors (``hetero_exec.genai.Model(path, executor="ray", stages=K)``).

* `split`: the rewritten decoder cut into stage models (Ray-free);
* `group`: one group's bookkeeping and cache on one stage (Ray-free);
* `runner`: a stage's step over its compiled segments;
* `stage`: the stage actor (admission, the ring, the driver's long poll);
* `pipeline`: the driver's side: actors, admission across stages, recovery;
* `generator`: `genai.Generator`'s API over the pipeline.
"""
