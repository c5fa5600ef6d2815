"""The run's settings: typed sections (job), the command line that fills them (cli), numeric
precision (precision)."""
