"""pycls: fast Vision Transformer training from one config file."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="pycls",
    version="0.1.0",
    description="Train Vision Transformers as fast as the hardware allows, from one config file",
    long_description=(Path(__file__).parent / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=find_packages(include=["pycls", "pycls.*"]),
    package_data={"pycls.core": ["upstream_keys.yaml"]},  # the upstream-key table (plain data)
    install_requires=[
        "torch>=2.10",  # the oldest that passed the suite (2.8 and 2.9 fail the pipeline tests)
        "torchvision>=0.25",
        "yacs>=0.1.8",
        "numpy",
        "simplejson",
        "iopath",
        "fairscale>=0.4.13",
        "scikit-learn",  # ships the bundled digits data set (no download)
        "matplotlib",  # training-curve and benchmark plots (imported only when plotting)
        "tqdm",  # progress bars on interactive terminals
        "submitit",  # sweeps on SLURM or local processes (imported only by the sweep tools)
        "safetensors>=0.4",  # weights files in and out (TRAIN.WEIGHTS, model_final.safetensors)
    ],
    # timm: from_timm and its tests only (imported lazily)
    extras_require={"dev": ["pytest>=8", "ruff>=0.6", "timm>=1.0"]},
)
