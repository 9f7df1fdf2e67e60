"""A buffer on S3 (or any S3-compatible server: MinIO, R2, Ceph...): write it, read it back.

    export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...         # or --key / --secret
    python examples/recipes/s3.py s3://my-bucket/runs/a                          # AWS S3
    python examples/recipes/s3.py s3://my-bucket/runs/a --endpoint-url http://127.0.0.1:9000   # MinIO

The bucket must exist (diskreplay creates objects, not buckets). The options given here go to
s3fs as ``storage_options``; what is not given, s3fs (botocore) takes from the environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL``,
``AWS_REGION``) or ``~/.aws/``. A writer commits with one PUT of ``commit.json`` after its
chunks; a reader anywhere sees whole commits only.
"""

from __future__ import annotations

import argparse

import numpy as np

import diskreplay as dr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="s3://bucket/prefix (replaced if a buffer is there)")
    p.add_argument("--endpoint-url", help="an S3-compatible server (default: AWS_ENDPOINT_URL, else AWS)")
    p.add_argument("--key", help="access key id (default: AWS_ACCESS_KEY_ID, ~/.aws)")
    p.add_argument("--secret", help="secret access key (default: AWS_SECRET_ACCESS_KEY, ~/.aws)")
    p.add_argument("--rows", type=int, default=10_000)
    args = p.parse_args(argv)
    options = {name: value for name, value in [("endpoint_url", args.endpoint_url), ("key", args.key),
                                               ("secret", args.secret)] if value is not None}
    fields = {"obs": dr.Field((17,), "float32"), "reward": dr.Field((), "float32"), "done": dr.Field((), "bool")}
    rng = np.random.default_rng(0)
    with dr.ReplayBuffer.create(args.url, fields, capacity=None, chunk_rows=4096, storage_options=options,
                                overwrite=True, retry=dr.RetryPolicy(attempts=6, budget_s=30.0)) as buf:
        buf.extend({"obs": rng.random((args.rows, 17)), "reward": rng.random(args.rows),
                    "done": np.arange(args.rows) % 1000 == 999})
        buf.flush()  # chunks first, then one PUT of commit.json: now any reader sees these rows
        print(f"wrote {len(buf):,} rows to {args.url}")
    with dr.ReplayBuffer.open(args.url, storage_options=options) as reader:  # read-only, from any machine
        batch = reader.sample(256)
        print(f"read back: {len(reader):,} rows, {len(reader.episodes())} episodes, "
              f"a batch of obs {batch['obs'].shape}, {reader.stats().chunks_loaded} chunks fetched")
    return 0


if __name__ == "__main__":
    main()
