"""Traces at a URL (store/remote.py) against a local S3 server (moto's, on 127.0.0.1): a record
and compare through it match the same run on disk bitwise; crash safety, --force, a missing
bucket, refused credentials, a missing extra, the bounded read cache, corruption."""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ENV, assert_one_line_error, run_cli

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = "driftcheck-test"
URL = f"s3://{BUCKET}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on 127.0.0.1 (stopped at the end), a bucket, the AWS variables set."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no request log on stderr
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_ENDPOINT_URL", endpoint)
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        try:
            yield endpoint
        finally:
            server.stop()


def _fs():
    import fsspec

    return fsspec.filesystem("s3", skip_instance_cache=True)


def _record(capsys, out, *args) -> None:
    code, _, err = run_cli(["-q", "record", "mlp", "--out", out, "--steps", "2", *args], capsys)
    assert code == 0, err


def _normalized(report: dict) -> dict:
    """A report without what differs between two records of the same run (ids, paths, times)."""
    def strip(o):
        if isinstance(o, dict):
            return {k: strip(v) for k, v in o.items()
                    if k not in ("run_id", "replay_id", "replay_of", "local_of", "created")}
        if isinstance(o, list):
            return [strip(v) for v in o]
        return o
    return strip(report)


def test_record_replay_compare_through_s3_match_disk_bitwise(s3, tmp_path, capsys):
    from driftcheck.store import TraceReader

    local = tmp_path / "local"
    _record(capsys, f"{URL}/ref")
    _record(capsys, str(local / "ref"))
    remote_ref, local_ref = TraceReader(f"{URL}/ref"), TraceReader(local / "ref")
    assert remote_ref.entries == local_ref.entries  # stats, checksums, shard names: all of it
    assert remote_ref.entries and all(e.get("tensor") for e in remote_ref.entries)
    for a, b in zip(remote_ref.entries, local_ref.entries):
        x, y = remote_ref.tensor(a), local_ref.tensor(b)
        assert x is not None and y is not None and x.dtype == y.dtype and x.shape == y.shape
        assert x.reshape(-1).view(torch.uint8).equal(y.reshape(-1).view(torch.uint8)), a["key"]
    replay_r, replay_l = remote_ref.read_replay()[0], local_ref.read_replay()[0]
    assert replay_r.keys() == replay_l.keys()
    assert all(replay_r[k].equal(replay_l[k]) for k in replay_r)
    remote_ref.close()
    names = sorted(p.rsplit("/", 1)[-1] for p in _fs().ls(f"{BUCKET}/ref"))
    assert "manifest.json" in names and "INCOMPLETE" not in names and "replay.safetensors" in names

    # a target replaying the reference at the URL (and its local replay, of the URL's tensors)
    _record(capsys, f"{URL}/tgt", "--replay", f"{URL}/ref", "--dtype", "bf16")
    _record(capsys, str(local / "tgt"), "--replay", str(local / "ref"), "--dtype", "bf16")
    reports = {}
    for side, ref, tgt in (("s3", f"{URL}/ref", f"{URL}/tgt"), ("local", local / "ref", local / "tgt")):
        code, _, err = run_cli(["-q", "compare", ref, tgt, "--json", tmp_path / f"{side}.json"], capsys)
        assert code == 0, err
        reports[side] = json.loads((tmp_path / f"{side}.json").read_text())
    assert reports["s3"]["entries"] and _normalized(reports["s3"]) == _normalized(reports["local"])
    target = TraceReader(f"{URL}/tgt")
    assert target.run["local_of"] == f"{URL}/ref"
    assert any(e["slot"].startswith("local.") for e in target.entries)
    target.close()

    # a report written to the bucket and rendered from it
    code, _, err = run_cli(["-q", "compare", f"{URL}/ref", f"{URL}/tgt", "--json", f"{URL}/report.json"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["-q", "report", f"{URL}/report.json", "--summary-md", tmp_path / "s.md"], capsys)
    assert code == 0 and (tmp_path / "s.md").read_text(), err


def test_force_replaces_only_a_trace(s3, tmp_path, capsys):
    _record(capsys, f"{URL}/again", "--steps", "1")
    code, _, err = run_cli(["record", "mlp", "--out", f"{URL}/again", "--steps", "1"], capsys)
    assert_one_line_error(code, err, "already exists", "--force")
    _record(capsys, f"{URL}/again", "--steps", "1", "--force")
    _fs().pipe_file(f"{BUCKET}/notes/readme.txt", b"not a trace")
    code, _, err = run_cli(["record", "mlp", "--out", f"{URL}/notes", "--steps", "1", "--force"], capsys)
    assert_one_line_error(code, err, "not a driftcheck trace")
    assert _fs().cat_file(f"{BUCKET}/notes/readme.txt") == b"not a trace"


def test_interrupted_upload_reads_as_incomplete(s3, tmp_path, capsys, monkeypatch):
    from driftcheck.store.remote import Remote
    from driftcheck.store.writer import TraceWriter

    # a crash after a shard went up: no manifest at the URL, the INCOMPLETE marker says so
    w = TraceWriter(f"{URL}/crash", shard_bytes=64, background=False)
    w.add({"key": "0/forward/a/0/output", "module": "a", "phase": "forward", "step": 0, "call": 0,
           "slot": "output", "order": 0, "shape": [16], "dtype": "float32", "stats": {}}, torch.ones(16))
    w.flush()
    names = sorted(p.rsplit("/", 1)[-1] for p in _fs().ls(f"{BUCKET}/crash"))
    assert names == ["INCOMPLETE", "shard-00000.safetensors"]
    code, _, err = run_cli(["compare", f"{URL}/crash", f"{URL}/crash"], capsys)
    assert_one_line_error(code, err, "incomplete", "in progress or interrupted")
    code, _, err = run_cli(["record", "mlp", "--out", tmp_path / "t", "--replay", f"{URL}/crash"], capsys)
    assert_one_line_error(code, err, "incomplete")
    shutil.rmtree(w.dir)  # the crashed writer's staging directory

    # the manifest's upload fails: the record exits 2 and the URL holds no manifest
    put = Remote.put

    def failing_put(self, src, name):
        if name == "manifest.json":
            raise PermissionError("simulated: the connection dropped")
        return put(self, src, name)
    monkeypatch.setattr(Remote, "put",
                        lambda self, src, name: self.guard("uploading", lambda: failing_put(self, src, name)))
    code, _, err = run_cli(["record", "mlp", "--out", f"{URL}/cut", "--steps", "1"], capsys)
    assert_one_line_error(code, err, f"{URL}/cut")
    monkeypatch.undo()
    assert not _fs().exists(f"{BUCKET}/cut/manifest.json")
    assert b"did not finish" in _fs().cat_file(f"{BUCKET}/cut/INCOMPLETE")
    code, _, err = run_cli(["compare", f"{URL}/cut", f"{URL}/cut"], capsys)
    assert_one_line_error(code, err, "incomplete", "did not finish")


def test_missing_bucket_and_refused_credentials_exit_2_in_one_line(s3, tmp_path, capsys):
    code, _, err = run_cli(["record", "mlp", "--out", "s3://no-such-bucket/ref", "--steps", "1"], capsys)
    assert_one_line_error(code, err, "bucket does not exist")
    code, _, err = run_cli(["compare", "s3://no-such-bucket/ref", "s3://no-such-bucket/tgt"], capsys)
    assert_one_line_error(code, err, "bucket does not exist")
    code, _, err = run_cli(["compare", f"{URL}/never-recorded", f"{URL}/never-recorded"], capsys)
    assert_one_line_error(code, err, "does not exist")

    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin

    before = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT, ActionAuthenticatorMixin.request_count = 0, 0  # check keys
    try:
        code, _, err = run_cli(["record", "mlp", "--out", f"{URL}/denied", "--steps", "1"], capsys)
        assert_one_line_error(code, err, "access denied", "credentials")
        code, _, err = run_cli(["compare", f"{URL}/ref", f"{URL}/ref"], capsys)
        assert_one_line_error(code, err, "access denied", "credentials")
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = before


def test_missing_extra_and_run_refused_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec fails: the extra is missing
    code, _, err = run_cli(["compare", "s3://b/ref", "s3://b/tgt"], capsys)
    assert_one_line_error(code, err, "driftcheck[cloud]")
    code, _, err = run_cli(["run", "mlp", "--target", "cpu", "--out", "s3://b/run"], capsys)
    assert_one_line_error(code, err, "driftcheck record --out URL")
    code, _, err = run_cli(["drill", "s3://b/ref", "s3://b/tgt"], capsys)
    assert_one_line_error(code, err, "the drill-down reruns each side from a local trace directory")
    for flag in ("--long", "--parallel=ddp"):
        code, _, err = run_cli(["record", "mlp", "--out", "s3://b/ref", flag], capsys)
        assert_one_line_error(code, err, "--long and --parallel record to a local directory")
    from driftcheck.errors import DriftcheckError
    from driftcheck.integrations.session import TraceSession
    from driftcheck.store.layout import rank_dir

    with pytest.raises(DriftcheckError, match="training-loop integrations record to and replay from local"):
        TraceSession("s3://b/ref")
    with pytest.raises(DriftcheckError, match="multi-rank run"):
        rank_dir("s3://b/ref", 0)


def test_local_paths_never_import_fsspec(tmp_path):
    code = ("import sys; from driftcheck.cli import main\n"
            "try: main(['-q', 'record', 'mlp', '--steps', '1', '--out', sys.argv[1]])\n"
            "except SystemExit as e: assert e.code == 0, e.code\n"
            "try: main(['-q', 'compare', sys.argv[1], sys.argv[1]])\n"
            "except SystemExit as e: assert e.code == 0, e.code\n"
            "assert 'fsspec' not in sys.modules, 'fsspec imported on a local path'\n")
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                ENV.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr


def test_bounded_cache_refetches_and_verifies(s3, tmp_path):
    from driftcheck.errors import TraceError
    from driftcheck.store import TraceReader, TraceWriter
    from driftcheck.store.remote import ShardCache

    tensors = {f"m{i}": torch.arange(64, dtype=torch.float32) * (i + 1) for i in range(5)}
    w = TraceWriter(f"{URL}/small", shard_bytes=256)
    for i, (name, t) in enumerate(tensors.items()):
        w.add({"key": f"0/forward/{name}/0/output", "module": name, "phase": "forward", "step": 0,
               "call": 0, "slot": "output", "order": i, "shape": [64], "dtype": "float32", "stats": {}}, t.clone())
    w.close({"steps": 1})
    assert len(w.shards) == 5
    r = TraceReader(f"{URL}/small")
    assert r.cache is not None
    r.cache.budget = 1  # one shard at a time: each read drops the one before
    for _ in range(2):
        for e in r.entries:
            assert r.tensor(e).equal(tensors[e["module"]])
            assert len(list(r.cache.dir.glob("shard-*"))) == 1
    cache_dir = r.cache.dir
    r.close()
    assert not cache_dir.exists()
    assert isinstance(r.cache, ShardCache)

    # a byte changed in place at the URL (same size): a corrupt trace, never drift
    key = f"{BUCKET}/small/shard-00002.safetensors"
    raw = bytearray(_fs().cat_file(key))
    raw[-1] ^= 0xFF
    _fs().pipe_file(key, bytes(raw))
    r = TraceReader(f"{URL}/small")
    with pytest.raises(TraceError, match="fail their checksum"):
        for e in r.entries:
            r.tensor(e)
    r.close()
