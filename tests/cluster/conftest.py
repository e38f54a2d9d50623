"""The test cluster for the job tests: one per module, with the operator installed and
SeaweedFS credentials in the Secret `s3-creds` of namespace `ml`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_jobs import NS
from seaweedfs import ACCESS_KEY, SECRET_KEY
from testcluster import ProcessCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, seaweed) -> Iterator[ProcessCluster]:
    with ProcessCluster(tmp_path_factory.mktemp("jobs-cluster"), nodes=2) as running:
        credentials = {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": seaweed.endpoint,
        }
        running.install_operator(NS, credentials, secret="s3-creds")
        yield running
