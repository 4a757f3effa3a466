"""Packaging: everything but the package list lives in setup.cfg.

The shipped models stay in the top-level ``engines/`` folder of the source
tree; the wheel carries them as ``wsi_pipeline/engines/`` (see
``wsi_pipeline/inference/shipped.py`` for the lookup order).
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["wsi_pipeline", "wsi_pipeline.*"]), "wsi_pipeline.engines"],
    package_dir={"wsi_pipeline.engines": "engines"},
    package_data={"wsi_pipeline.engines": ["*.onnx", "*.card.json"]},
)
