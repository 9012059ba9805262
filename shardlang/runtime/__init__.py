"""The runtime: run a lowered program on a model in a process group, and put the model back if a step fails."""
