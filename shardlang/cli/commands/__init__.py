"""The subcommands, one module each: every one takes the parsed arguments and returns the exit status."""
