"""--dump-requests-folder's writer: one JSON line a finished request, its whole text (taken by
its coroutine or not yet), and the file rotated to `.1.jsonl` past half the bound."""

from __future__ import annotations

import orjson

from protocol.records import Finish
from protocol.sampling_params import SamplingParams
from runtime.http_worker.req_state import ReqGroup, ReqState
from runtime.http_worker.request_dump import RequestDump


def finished_group() -> ReqGroup:
    group = ReqGroup(["gen-1"], 0, 1e9, 0)
    state = ReqState(group, 0, 0, 1, SamplingParams(temperature=0.0), 3)
    group.states.append(state)
    return group


def test_lines_hold_inputs_and_the_whole_text(tmp_path):
    dump = RequestDump(str(tmp_path), 0, 1 << 20)
    group = finished_group()
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    dump.submitted(group, "generate", [[1, 2, 3]], [params], 1)
    state = group.states[0]
    state.parts = [b"Hello"]
    assert state.take()[0] == "Hello"
    state.parts, state.finish, state.completion_tokens = [b", world"], Finish.LENGTH, 5
    dump.ended(group)
    line = orjson.loads((tmp_path / "requests-w0.jsonl").read_bytes())
    assert line["prompts"] == [[1, 2, 3]] and line["sampling_params"][0]["max_new_tokens"] == 5
    assert line["outputs"] == [
        {
            "text": "Hello, world",
            "finish_reason": "length",
            "prompt_tokens": 3,
            "completion_tokens": 5,
            "cached_tokens": 0,
        }
    ]


def test_rotation_bounds_the_dump(tmp_path):
    dump = RequestDump(str(tmp_path), 3, 4096)
    for _ in range(40):
        group = finished_group()
        dump.submitted(group, "generate", [[7] * 20], [SamplingParams()], 1)
        group.states[0].finish = Finish.STOP
        dump.ended(group)
    dump.close()
    current, rotated = tmp_path / "requests-w3.jsonl", tmp_path / "requests-w3.1.jsonl"
    assert rotated.exists() and current.stat().st_size + rotated.stat().st_size <= 4096
    assert all(orjson.loads(line)["endpoint"] == "generate" for line in current.read_bytes().splitlines())
