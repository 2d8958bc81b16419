"""`pdmesh up` / `serve` bound what their gateway takes in flight (429 + Retry-After
past it): as asked, or twice the batch slots of the engines that decode."""

from __future__ import annotations

from pdmesh.shared.cli.up import plan
from pdmesh.shared.config.serve import serve_config


def bound(command: str, *words: str, log_dir) -> tuple[int, int]:
    cfg = serve_config(command, [*words, "--log-dir", str(log_dir)])
    p = plan(cfg)
    return p.slots, p.queue_bound(cfg.flags.max_queued_requests)


def test_twice_the_decoding_slots_unless_asked(qwen3_path, tmp_path):
    model = str(qwen3_path)
    assert bound("up", model, log_dir=tmp_path) == (256, 512)  # (--max-num-seqs 256)
    assert bound("up", model, "--decode", "2", "--prefill", "3", "--decode-args",
                 "--max-num-seqs 8 --data-parallel-size 2", log_dir=tmp_path) == (32, 64)
    assert bound("serve", model, "--max-num-seqs", "4", log_dir=tmp_path) == (4, 8)
    assert bound("up", model, "--max-queued-requests", "5", log_dir=tmp_path)[1] == 5
    assert bound("serve", model, "--max-queued-requests", "3", log_dir=tmp_path)[1] == 3
