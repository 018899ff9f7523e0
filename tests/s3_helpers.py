"""An S3-compatible object store on 127.0.0.1 for storage tests: moto's server mode in a thread of the test
process, reached by every client (this process, spawned ranks, Dask workers) through fsspec's configuration.

fsspec reads ``FSSPEC_S3`` (JSON keyword arguments of ``s3fs.S3FileSystem``) from the environment at import, so
child processes inherit it; this process's already-imported fsspec gets the same through ``fsspec.config.conf``.

Example:
    with s3_store("bucket") as endpoint:
        tl.arm("s3://bucket/run")
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import urllib.request
from collections.abc import Iterator

import pytest

_KEYS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def s3_config(options: dict) -> Iterator[None]:
    """``s3://`` URLs opened with ``options`` (s3fs keyword arguments) here and in child processes."""
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("s3fs")
    saved_env = {k: os.environ.get(k) for k in ("FSSPEC_S3", *_KEYS)}
    saved_conf = fsspec.config.conf.get("s3")
    os.environ.update(_KEYS, FSSPEC_S3=json.dumps(options))
    fsspec.config.conf["s3"] = dict(options)
    fsspec.filesystem("s3").clear_instance_cache()
    try:
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if saved_conf is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved_conf
        fsspec.filesystem("s3").clear_instance_cache()


@contextlib.contextmanager
def s3_store(*buckets: str) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (a free port) with ``buckets`` created; yields its endpoint URL."""
    server_mod = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    # moto keeps its buckets in process-wide state: an earlier server's objects would still be there.
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).close()
    try:
        with s3_config({"endpoint_url": endpoint}):
            import fsspec

            fs = fsspec.filesystem("s3")
            for bucket in buckets:
                fs.mkdir(bucket)
            yield endpoint
    finally:
        server.stop()


def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unreachable_store() -> contextlib.AbstractContextManager:
    """``s3://`` pointed at a closed port, failing fast (one attempt, 1 s connect timeout)."""
    options = {
        "endpoint_url": f"http://127.0.0.1:{closed_port()}",
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
    }
    return s3_config(options)


def s3_objects(prefix: str) -> list[str]:
    """Every object key under ``s3://prefix`` (recursive), as URLs."""
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return sorted(f"s3://{p}" for p in fs.find(prefix))
