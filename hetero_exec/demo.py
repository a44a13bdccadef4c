"""The built-in demo model: a tiny detector whose post-processing the GPU declines.

A convolutional backbone (device-friendly) predicts boxes and class scores on an 8x8
grid; NonMaxSuppression (a host-only kernel: a greedy, data-dependent loop) selects
detections; GatherND picks their boxes. With ``providers=["sim-gpu", "cpu"]`` the
default is a whole-session fallback with a report; ``hetero=True`` splits it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IMAGE = 32
GRID = 8
CLASSES = 3


def detector_model(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)

    def w(name: str, *shape: int, scale: float = 0.2) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    def c(name: str, values, dtype=np.int64) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)

    inits = [
        w("conv1_w", 16, 3, 3, 3), w("conv1_b", 16),
        w("bn_scale", 16, scale=0.1), w("bn_bias", 16, scale=0.1),
        numpy_helper.from_array(np.zeros(16, np.float32), "bn_mean"),
        numpy_helper.from_array(np.ones(16, np.float32), "bn_var"),
        w("conv2_w", 32, 16, 3, 3), w("conv2_b", 32),
        w("box_w", 4, 32, 1, 1), w("box_b", 4),
        w("cls_w", CLASSES, 32, 1, 1), w("cls_b", CLASSES),
        c("boxes_shape", [0, 4, GRID * GRID]), c("scores_shape", [0, CLASSES, GRID * GRID]),
        c("max_out", [10]), numpy_helper.from_array(np.array([0.5], np.float32), "iou"),
        numpy_helper.from_array(np.array([0.3], np.float32), "score_thr"),
        c("batch_box_cols", [0, 2]),
    ]
    n = helper.make_node
    nodes = [
        n("Conv", ["image", "conv1_w", "conv1_b"], ["c1"], pads=[1, 1, 1, 1], name="backbone/conv1"),
        n("BatchNormalization", ["c1", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["b1"], name="backbone/bn1"),
        n("Relu", ["b1"], ["r1"], name="backbone/relu1"),
        n("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="backbone/pool1"),
        n("Conv", ["p1", "conv2_w", "conv2_b"], ["c2"], pads=[1, 1, 1, 1], name="backbone/conv2"),
        n("Relu", ["c2"], ["r2"], name="backbone/relu2"),
        n("MaxPool", ["r2"], ["feat"], kernel_shape=[2, 2], strides=[2, 2], name="backbone/pool2"),
        n("Conv", ["feat", "box_w", "box_b"], ["box_raw"], name="head/boxes"),
        n("Sigmoid", ["box_raw"], ["box_sig"], name="head/box_sigmoid"),
        n("Reshape", ["box_sig", "boxes_shape"], ["box_flat"], name="head/box_reshape"),
        n("Transpose", ["box_flat"], ["boxes"], perm=[0, 2, 1], name="head/box_transpose"),
        n("Conv", ["feat", "cls_w", "cls_b"], ["cls_raw"], name="head/classes"),
        n("Sigmoid", ["cls_raw"], ["cls_sig"], name="head/cls_sigmoid"),
        n("Reshape", ["cls_sig", "scores_shape"], ["scores"], name="head/cls_reshape"),
        n("NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "score_thr"], ["selected"],
          center_point_box=0, name="post/nms"),
        n("Gather", ["selected", "batch_box_cols"], ["sel_bb"], axis=1, name="post/pick_cols"),
        n("GatherND", ["boxes", "sel_bb"], ["det_boxes"], name="post/gather_boxes"),
    ]
    graph = helper.make_graph(
        nodes, "demo_detector",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, IMAGE, IMAGE])],
        [helper.make_tensor_value_info("selected", TensorProto.INT64, ["M", 3]),
         helper.make_tensor_value_info("det_boxes", TensorProto.FLOAT, ["M", 4]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", CLASSES, GRID * GRID])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="hetero_exec.demo")
    onnx.checker.check_model(model)
    return model


def demo_inputs(batch: int = 2, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"image": rng.standard_normal((batch, 3, IMAGE, IMAGE)).astype(np.float32)}
