"""megatron-rl: RL post-training for Mixture-of-Experts LLMs on Megatron-Core.

Every dependency is pinned here and only here. torch is the CPU build on machines without a GPU:
`pip install torch==2.13.0` takes the wheel that lies on disk; an unpinned torch would pull a
multi-GB CUDA build. megatron-core 0.16.x is the newest release for Python 3.11 (0.17+ needs 3.12).
"""

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "numpy==2.4.6",
    "pyyaml==6.0.4",
    # megatron-core needs these without declaring them: dist_checkpointing's save hangs its
    # writer processes without psutil; the inference engine imports tqdm.
    "psutil==7.2.2",
    "tqdm==4.70.1",
    # Hugging Face checkpoints: reference models in the tests, config classes, safetensors I/O.
    # One transformers for the whole project: SGLang 0.5.23 runs with 5.19.
    "transformers==5.19.0",
    "safetensors==0.8.0",
    # Prompt files: parquet through Hugging Face datasets (megatron_rl/rewards/datasets.py);
    # the `math` verifier's answer equivalence through Hugging Face math-verify.
    "datasets==5.2.0",
    "math-verify==0.9.0",
]

# Experiment tracking; megatron_rl.metrics imports it lazily. The tests run a real offline run.
WANDB = "wandb==0.31.0"
# The drift benchmark's plots (megatron_rl/bench/drift/report.py, imported only to report).
MATPLOTLIB = "matplotlib==3.11.2"

EXTRAS_REQUIRE = {
    # What scripts/test.sh installs: the test runner, its per-test time limit and its worker
    # processes (xdist: the suite runs on both cores), property tests, the linter, wandb and
    # matplotlib (the drift benchmark's test draws its plots).
    "test": [
        "pytest==9.2.0",
        "pytest-timeout==2.4.0",
        "pytest-xdist==3.8.0",
        "execnet==2.1.2",
        "hypothesis==6.170.17",
        "ruff==0.17.6",
        WANDB,
        MATPLOTLIB,
    ],
    # GPU clusters only: Transformer Engine layer specs and fused kernels.
    "gpu": ["transformer-engine[pytorch]==2.20.2"],
    # The production rollout backend.
    "sglang": ["sglang==0.5.23"],
    "wandb": [WANDB],
    "bench": [MATPLOTLIB],
}

setup(
    name="megatron-rl",
    version="0.1.0",
    description="RL post-training (GSPO, GRPO + replay, SSPO) for MoE LLMs on Megatron-Core",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)
