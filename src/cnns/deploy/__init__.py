"""A trained model put to use outside training: rebuilt from a run folder or checkpoint (`restored.py`) and
written as ONNX or AOTInductor files (`graphs.py`), for predict, export, inference_embedded.py and the
inference backends of `cnns benchmark`."""
