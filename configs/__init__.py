# Hydra config groups, installed as the package `crm_configs` (see setup.py).
