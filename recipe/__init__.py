"""The recipe: its schema (`schema.py`) and its loader (`config.py`: `load_config`, `save_config`).

It sits between the model-side packages and the programs: it imports only the light `config`
modules of data/, models/ and optim/, data/sim_env.py's task table (and utils), and checkpoint/,
train/ and inference/ import it.
"""
