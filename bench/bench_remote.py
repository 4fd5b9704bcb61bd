"""Checkpoints in a bucket: dcpctl against boto3's transfer manager and torch's FsspecReader, on
the real-weights checkpoint served by `rclone serve s3` on 127.0.0.1, side by side.

- inspect: the requests it sends, counted on moto's server (never timed there: moto copies the
  whole object for every ranged read);
- verify and compress bucket -> bucket: wall time and peak RSS against boto3's transfer
  manager on the same objects: its server-side copy (what `aws s3 cp s3://a s3://b` does), a
  download of every object, and a download and upload through the client; bytes over the
  loopback (both directions, /proc/net/dev) against the bytes the command needed;
- loading the 4-rank checkpoint from the bucket: dcpctl.storage_reader against torch's
  FsspecReader, each in a fresh process.

Usage: python bench/bench_remote.py [--units 11] [--repeat 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from harness import dcpctl_command, measure, print_table, python_command  # noqa: E402
from real_checkpoint import ONE_GB_UNITS, OUT_ROOT, real_checkpoint  # noqa: E402
from s3_servers import moto_server, rclone_server  # noqa: E402

TRANSFER_MANAGER = """
import sys, boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
mode, bucket, source, target = sys.argv[1:5]
client = boto3.client("s3", config=Config(response_checksum_validation="when_required",
                                          s3={"addressing_style": "path"}))
keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=source + "/") for o in page.get("Contents", [])]
config = TransferConfig()
spool = "/tmp/dcpctl-bench-spool"
for key in keys:
    new_key = target + key[len(source):]
    if mode == "server-copy":  # one CopyObject each: rclone answers UploadPartCopy without an ETag
        client.copy({"Bucket": bucket, "Key": key}, bucket, new_key,
                    Config=TransferConfig(multipart_threshold=5 << 30))
    elif mode == "download":
        client.download_file(bucket, key, spool, Config=config)
    else:
        client.download_file(bucket, key, spool, Config=config)
        client.upload_file(spool, bucket, new_key, Config=config)
"""

LOAD = """
import sys, time
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
if sys.argv[1] == "dcpctl":
    import dcpctl
    reader = dcpctl.storage_reader(sys.argv[2])
else:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    import os
    reader = FsspecReader(sys.argv[2], endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])
state = {}
_load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(),
                 no_dist=True)
print(len(state))
"""


def loopback_bytes() -> int:
    """Bytes received on the loopback interface so far (each byte sent on it is received)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[0])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def objects_bytes(client, bucket: str, prefix: str) -> int:
    return sum(entry["Size"] for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix + "/") for entry in page.get("Contents", []))


def delete_prefix(client, bucket: str, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                 Prefix=prefix + "/"):
        keys = [{"Key": entry["Key"]} for entry in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def count_inspect_requests(source: Path) -> list[str]:
    """The requests `dcpctl inspect` sends, as moto's server logs them."""
    requests: list[str] = []

    class Counter(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            requests.append(record.getMessage())

    with moto_server() as server:
        os.environ.update(server.environment())
        bucket = server.new_bucket()
        client = server.client()
        for path in sorted(source.iterdir()):
            client.upload_file(str(path), bucket, f"ck/{path.name}")
        werkzeug = logging.getLogger("werkzeug")
        werkzeug.setLevel(logging.INFO)
        werkzeug.addHandler(Counter())
        werkzeug.propagate = False
        measure("inspect", dcpctl_command("inspect", f"s3://{bucket}/ck"))
        werkzeug.handlers.clear()
    return [line.split('"')[1] for line in requests if '"' in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=ONE_GB_UNITS)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    source = real_checkpoint(args.units, 4)
    needed = sum(path.stat().st_size for path in source.iterdir())

    inspect_requests = count_inspect_requests(source)
    print(f"inspect sent {len(inspect_requests)} requests:")
    for request in inspect_requests:
        print(f"  {request}")

    root = OUT_ROOT / "rclone-root"
    shutil.rmtree(root, ignore_errors=True)
    (root / "bench").mkdir(parents=True)
    shutil.copytree(source, root / "bench" / "ck")
    with rclone_server(root) as server:
        os.environ.update(server.environment())
        client = server.client()
        objects_bytes(client, "bench", "ck")  # rclone hashes each file once for its ETag
        rows = []
        contenders = [
            ("boto3 transfer manager: server-side copy", "tm-copy",
             python_command(TRANSFER_MANAGER) + ["server-copy", "bench", "ck", "tm-copy"]),
            ("boto3 transfer manager: download every object", None,
             python_command(TRANSFER_MANAGER) + ["download", "bench", "ck", "-"]),
            ("boto3 transfer manager: download + upload", "tm-moved",
             python_command(TRANSFER_MANAGER) + ["through", "bench", "ck", "tm-moved"]),
            ("dcpctl verify s3://bench/ck", None,
             dcpctl_command("verify", "s3://bench/ck")),
            ("dcpctl compress s3://bench/ck -o s3://bench/ck-z", "ck-z",
             dcpctl_command("compress", "s3://bench/ck", "-o", "s3://bench/ck-z")),
            ("load 4 ranks: torch FsspecReader", None,
             python_command(LOAD) + ["torch", "s3://bench/ck"]),
            ("load 4 ranks: dcpctl.storage_reader", None,
             python_command(LOAD) + ["dcpctl", "s3://bench/ck"]),
        ]
        best: dict[str, tuple] = {}
        for _ in range(args.repeat):
            for label, output, command in contenders:
                if output:
                    delete_prefix(client, "bench", output)
                before = loopback_bytes()
                run = measure(label, command)
                traffic = loopback_bytes() - before
                written = objects_bytes(client, "bench", output) if output else 0
                if label not in best or run.seconds < best[label][0].seconds:
                    best[label] = (run, traffic, written)
        for label, _, _ in contenders:
            run, traffic, written = best[label]
            fetched = traffic - written
            # a server-side copy moves nothing through the client: no ratio to print
            ratio = f"{fetched / needed:.3f}" if fetched > 0 else "n/a"
            rows.append((label, f"{run.seconds:.2f}", f"{run.peak_rss_bytes / 2**20:.0f}",
                         f"{traffic / 1e6:.0f}", f"{written / 1e6:.0f}", ratio))
        print(f"\ncheckpoint: {needed / 1e6:.0f} MB in 4 data files + .metadata; best of "
              f"{args.repeat}; loopback MB counts both directions, fetched/needed is "
              "(loopback - written) / checkpoint bytes")
        print_table(rows, ("contender", "seconds", "peak RSS MiB", "loopback MB", "written MB",
                           "fetched/needed"))
        seconds = {label: best[label][0].seconds for label in best}
        for mine, theirs in [("dcpctl verify s3://bench/ck",
                              "boto3 transfer manager: download every object"),
                             ("dcpctl compress s3://bench/ck -o s3://bench/ck-z",
                              "boto3 transfer manager: download + upload"),
                             ("dcpctl compress s3://bench/ck -o s3://bench/ck-z",
                              "boto3 transfer manager: server-side copy"),
                             ("load 4 ranks: dcpctl.storage_reader",
                              "load 4 ranks: torch FsspecReader")]:
            print(f"{mine} / {theirs}: {seconds[mine] / seconds[theirs]:.2f}x")


if __name__ == "__main__":
    main()
