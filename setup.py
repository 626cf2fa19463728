"""pycls: fast Vision Transformer training from one config file."""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithConfigs(build_py):
    """Ships configs/ inside the package as pycls/configs, so that an installed wheel resolves
    ``--cfg quickstart`` (pycls.config.bundled_configs_dir); the checkout keeps configs/ at
    the top, where the README's commands name it."""

    def run(self):
        super().run()
        self.copy_tree("configs", str(Path(self.build_lib) / "pycls" / "configs"))


# The lowest versions that passed tests/datasets/formats/test_data_formats.py
_DATA = ["webdataset>=0.2.86", "braceexpand", "pyarrow>=16", "fsspec>=2023.12", "aiohttp>=3.9"]

setup(
    # Meta's original is "pycls" on PyPI (0.1.1 and older, a different code base): this fork is
    # published under its own name; the import name stays pycls
    name="pycls-vit",
    version="0.1.0",
    description="Train Vision Transformers as fast as the hardware allows, from one config file",
    long_description=(Path(__file__).parent / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=find_packages(include=["pycls", "pycls.*"]),
    package_data={"pycls.config": ["upstream_keys.yaml"]},  # the upstream-key table (plain data)
    cmdclass={"build_py": BuildPyWithConfigs},
    entry_points={"console_scripts": ["pycls = pycls.__main__:main"]},
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
    # timm: from_timm, OPTIM.OPTIMIZER timm:NAME and their tests only (imported lazily)
    # setuptools>=70.1 builds wheels without the "wheel" package (tests/end_to_end/test_install.py
    # builds one);
    # tensorboard: TENSORBOARD True and its test only (imported lazily); torchcodec: the image
    # decoder pycls prefers where installed (pycls.datasets.formats.decode), so CI compares it with
    # torchvision's; torchao: AMP.FLOAT8's conversion, tested on the CPU
    # data: WebDataset tar shards and Hugging Face parquet files, local or at a URL
    # (DATA_LOADER.BACKEND wds / parquet, tools/prepare_dataset.py --format wds / parquet; each
    # imported only there): webdataset (and its braceexpand) for tars, pyarrow for parquet, fsspec
    # (aiohttp for http) for URLs; s3fs, gcsfs or huggingface_hub add their protocols.
    # datasets: the tests read the written parquet with it alone
    extras_require={
        "data": _DATA,
        # AMP.FLOAT8 (imported lazily). Each torchao release is built for one torch release: install
        # the one made for yours (tested: torchao 0.18 with torch 2.14)
        "float8": ["torchao"],
        # OPTIM.OPTIMIZER schedulefree_adamw (imported lazily); timm: OPTIM.OPTIMIZER timm:NAME,
        # from_timm, timm teachers
        "schedulefree": ["schedulefree>=1.4"],
        "timm": ["timm>=1.0"],
        "dev": [
            # below 9.2: pytest 9.2 derives a test's id from its node, so pytest-xdist 3.8's
            # loadgroup (which renames the id) no longer keeps a file's tests that share a fixture
            # on one worker; the fixture is then built once per worker
            "pytest>=8,<9.2",
            "pytest-xdist>=3.6",  # the README's test command runs on two workers (-n 2)
            "pytest-timeout>=2.2",  # a hung test fails alone, naming itself
            "ruff>=0.6",
            "timm>=1.0",
            "setuptools>=70.1",
            "tensorboard",
            "torchcodec>=0.16",
            *_DATA,
            "datasets>=3.0",
            "torchao",
            "schedulefree>=1.4",
            # tests/docs/test_reading_page.py: the quickstart epoch's path, measured under coverage
            "coverage>=7.0",
        ],
    },
)
