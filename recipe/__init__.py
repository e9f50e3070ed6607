"""The recipe: its schema (`schema.py`), its loader (`config.py`: `load_config`, `save_config`) and the
schema rendered as TRAINING.md's config reference (`config_doc.py`).

It sits between the model-side packages and the programs: it imports only the light `config`
modules of data/, models/ and optim/, data/sim_env.py's task table (and utils), and checkpoint/,
train/ and inference/ import it.
"""
