"""Object storage behind one small interface: local folders (`file://`) and S3, with
retries and error messages that never carry credentials. Checkpoints and weight
publication both store through it."""
