"""The training application: typed configs, job setup, the train loop, logging and checkpoints.
It assembles `topoep` (the library) with megatron-core, Hydra and W&B; `topoep` imports none of it."""
