"""The `rlft` command line (`main`) and the commands that run the trainer (`training`)."""
