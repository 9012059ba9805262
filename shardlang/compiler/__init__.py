"""The compiler: resolve a plan on a (meta) model, predict placements, lint it (SL2xx) and lower it to a program."""
