from setuptools import find_packages, setup

# The versions the test suite runs against, pinned together. torch is pinned here AND on the
# pip command line (Makefile): without the pin in the same command pip resolves a multi-GB CUDA build.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "lightning==2.6.6",
    "transformers==5.23.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "hydra-core==1.3.8",
    "omegaconf==2.3.1",
    "webdataset==1.0.2",
    "wandb==0.31.0",
    "numpy==2.4.6",
    "scipy==1.17.1",
    "matplotlib==3.11.2",
    "filelock==4.2.11",
    # crm-data criteria/topics: the official OpenAI client (any OpenAI-compatible endpoint), the
    # offline topic clustering, the progress bar, and Parquet votes (the Hugging Face downloads).
    "openai==3.51.0",
    "scikit-learn==1.9.1",
    "tqdm==4.70.1",
    "pyarrow==26.0.1",
    # the OpenRLHF reward server (crm/rl/openrlhf.py): one event loop holds OpenRLHF's thousands of
    # concurrent requests; the standard library's thread per connection spent 40-80% more CPU on
    # 2048 of them (benchmarks/openrlhf_load.py, docs/RL.md). Pure Python (h11, click).
    "uvicorn==0.54.0",
    # lora.rank > 0: LoRA adapters injected into the decoder's linears (crm/models/lora.py)
    "peft==0.21.2",
]
APP_REQUIRES = ["gradio==6.31.0"]  # scikit-learn (similarity selection) is a core requirement
RL_REQUIRES = ["trl==1.16.0"]  # crm-rl and crm.CRMReward with TRL's trainers (datasets comes with it)
# engine=ray (crm/inference/engine.py): scoring over Ray workers and nodes. Ray core only (actors,
# no ray[data]); the same ray on every node of a cluster, so pinned exactly.
RAY_REQUIRES = ["ray==2.60.0"]

setup(
    name="crm",
    version="0.1.0",
    description="Customizable Reward Models and user-centric subjective leaderboards",
    python_requires=">=3.10",
    # configs/ stays top-level for users to edit, and installs as the package `crm_configs` so an
    # installed crm-train finds it from any directory (Hydra's pkg://crm_configs).
    packages=find_packages(include=["crm", "crm.*", "data_tools", "data_tools.*"]) + ["crm_configs"],
    package_dir={"crm_configs": "configs"},
    package_data={"crm_configs": ["*.yaml", "*/*.yaml", "*/*/*.yaml"], "data_tools": ["*.yaml"]},
    install_requires=INSTALL_REQUIRES,
    extras_require={
        "gpu": ["flash-attn==2.8.3"],
        "slurm": ["hydra-submitit-launcher==1.2.0"],
        # crm-usl, the leaderboard web app. Gradio breaks APIs between minor releases: pinned exactly.
        "app": APP_REQUIRES,
        # crm-rl: GRPO with a CRM reward (TRL); the OpenRLHF server and verl function need no extra
        "rl": RL_REQUIRES,
        # engine=ray: crm-eval, crm-leaderboard and crm-usl scoring on a Ray cluster (SLURM.md)
        "ray": RAY_REQUIRES,
        # `crm-data topics --embedder DIR`: cluster sentence embeddings of a local model
        "embed": ["sentence-transformers==6.2.0"],
        # The tests compose the SLURM launcher config, drive the app (playwright: its browser
        # tests, with the system's chromium), run crm-rl and score on Ray, so dev includes the
        # slurm, app, rl and ray extras. pytest-xdist: `make test` runs the suite on two workers
        # (tests/conftest.py shares the cores).
        "dev": ["pytest==9.2.0", "pytest-xdist==3.8.0", "execnet==2.1.2", "ruff==0.17.5",
                "hydra-submitit-launcher==1.2.0", "playwright==1.65.2", *APP_REQUIRES, *RL_REQUIRES,
                *RAY_REQUIRES],
    },
    entry_points={
        "console_scripts": [
            "crm-data=data_tools.cli:main",
            "crm-train=crm.cli.train:main",
            "crm-export=crm.cli.export:main",
            "crm-report=crm.cli.report:main",
            "crm-plan=crm.cli.plan:main",
            "crm-eval=crm.cli.eval:main",
            "crm-leaderboard=crm.cli.leaderboard:main",
            "crm-usl=crm.cli.usl:main",
            "crm-rl=crm.cli.rl:main",
        ],
    },
)
