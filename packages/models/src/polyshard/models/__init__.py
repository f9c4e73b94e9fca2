"""polyshard.models: the model families polyshard trains, as plain PyTorch modules with no parallelism
inside. :mod:`.common` holds the blocks every family shares."""
