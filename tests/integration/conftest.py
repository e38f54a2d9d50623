"""Fixtures of the integration tests (each family in its own module)."""

from checkpoint_fixtures import bucket, s3_env, seaweed, store  # noqa: F401  (SeaweedFS S3 server)
