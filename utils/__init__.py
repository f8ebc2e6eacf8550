"""What every script shares and is not the lesson: command line, data, process
setup, metrics, checkpoints. The strategy itself is written out in each script."""
