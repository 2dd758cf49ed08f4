"""The node-loss scenario of tests/test_storage.py, run in its own process: a local multi-node
cluster lives and dies with this process, so no Ray client of it outlives the scenario inside pytest.

Usage: python node_loss_scenario.py <storage uri> <bucket> <endpoint> <workdir>; prints one JSON line.
"""

import json
import subprocess
import sys
import time

import boto3
from ray.cluster_utils import Cluster


def main(uri: str, bucket: str, endpoint: str, workdir: str) -> None:
    s3 = boto3.client("s3", endpoint_url=endpoint)
    keys = lambda prefix: sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))  # noqa: E731
    text = lambda key: s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode()  # noqa: E731
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    try:
        cluster.wait_for_nodes()
        run = subprocess.Popen(
            [sys.executable, "-m", "raysys", "train", "deep_gpcm", "--preset", "quick", "--workers", "2",
             "--address", cluster.address, "--storage-path", uri, "--name", "lost", "--max-failures", "2",
             "--set", "train.epochs=30", "--set", "train.checkpoint_every_steps=3"],
            cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 400
        while not any(k.endswith("/meta.json") for k in keys("runs/lost/checkpoints/")):
            if run.poll() is not None or time.time() > deadline:
                out, err = run.communicate()
                print(json.dumps({"error": "no checkpoint reached S3", "stdout": out[-3000:], "stderr": err[-3000:]}))
                return
            time.sleep(0.5)
        rank0 = text("runs/lost/events.log").split("rank 0 on node ")[-1].split()[0]
        done_before = max(int(k.split("step_")[1].split("/")[0]) for k in keys("runs/lost/checkpoints/")
                          if k.endswith("/meta.json"))
        (victim,) = [n for n in nodes if n.node_id == rank0]
        cluster.remove_node(victim)
        out, err = run.communicate(timeout=600)
        print(json.dumps({"returncode": run.returncode, "rank0_before": rank0, "done_before": done_before,
                          "events": text("runs/lost/events.log"), "keys": keys("runs/lost/"),
                          "stdout": out[-3000:], "stderr": err[-3000:]}))
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
