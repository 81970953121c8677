"""Using a trained model outside training: `cnns predict` and `cnns export`.

* `cnns.inference.predict` (`predict`): classify image files with a run's checkpoint, top-k
  labels and probabilities per image. It also holds what both commands share: rebuilding a run's
  model from its arguments.json and a checkpoint (`restore_model`), and the run's input
  normalisation.
* `cnns.inference.export` (`export`): write the model as an ONNX graph (torch's dynamo
  exporter) or an AOTInductor `.pt2` package, taking float32 NCHW or uint8 NHWC images.

Nothing is imported here, so `import cnns.inference` stays cheap; import the submodules.
"""

__all__ = ["predict", "export"]
