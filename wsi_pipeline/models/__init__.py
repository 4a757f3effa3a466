"""Training and export of the shipped demo detectors.

``net`` (the torch model), ``train`` (``python -m wsi_pipeline.models.train``)
and ``export`` need torch; ``data`` (synthetic training/evaluation tiles) and
``evaluate`` (precision/recall with pycocotools, Dice) need only numpy and
OpenCV, so quality checks run without torch.
"""

from pathlib import Path

# Where training writes without an explicit output folder (never engines/, which holds the shipped models).
DEFAULT_TRAIN_OUT = Path("trained_models")
