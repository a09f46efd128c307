"""The public-trace readers on small files written exactly as published (column
names, timestamp formats): request counts, each request's lengths and arrival
offsets (within 1 ms after the time scale), the common options, and the
one-line error of a bad file. Every expected value is worked out by hand from
the file's text, not by the reader's code."""

from __future__ import annotations

import hashlib
import json

import pytest

from servelab.errors import ConfigError
from servelab.lab.workload import make_workload

VOCAB = 512
MS = 1e-3

BURSTGPT = """\
Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,388,805,Conversation log
125.5,ChatGPT,2360,124,2484,API log
130,ChatGPT,97,61,158,Conversation log
"""

AZURE = """\
TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 23:59:59.9999999,879,6
2023-11-17 00:00:01.0000001,1020,201
"""

MOONCAKE = [
    {"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": list(range(14))},
    {"timestamp": 0, "input_length": 7319, "output_length": 490,
     "hash_ids": [0, *range(14, 28)]},
    {"timestamp": 3052, "input_length": 7234, "output_length": 794,
     "hash_ids": [0, *range(28, 42)]},
]  # fmt: skip

SHAREGPT = [
    {"id": "a1", "conversations": [
        {"from": "human", "value": "Hello, who are you?"},  # Hello , who are you ? : 6
        {"from": "gpt", "value": "I am a model."},  # I am a model . : 5
        {"from": "human", "value": "Tell me more"},  # 3
        {"from": "gpt", "value": "Sure: more."},  # Sure : more . : 4
    ]},
    {"id": "b2", "conversations": [
        {"from": "gpt", "value": "Hi"},  # history only: 1
        {"from": "human", "value": "x y z"},  # 3
        {"from": "gpt", "value": "ok"},  # 1
    ]},
]  # fmt: skip


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def jsonl(items) -> str:
    return "".join(json.dumps(item) + "\n" for item in items)


def shape(requests) -> list[tuple[int, int]]:
    return [(len(r.prompt_token_ids), r.params.max_tokens) for r in requests]


def offsets_match(requests, expected: list[float]) -> bool:
    return len(requests) == len(expected) and all(
        abs(r.arrival_time - t) <= MS for r, t in zip(requests, expected)
    )


# -- each format as published


def test_burstgpt_rows_lengths_and_offsets(tmp_path):
    path = write(tmp_path, "BurstGPT_1.csv", BURSTGPT)
    requests = make_workload({"name": "burstgpt", "path": path}, VOCAB)
    # the row with 0 response tokens (a failure) is skipped and counted
    assert shape(requests) == [(472, 18), (417, 388), (2360, 124), (97, 61)]
    assert offsets_match(requests, [0.0, 113.0, 120.5, 125.0])
    assert requests.source["skipped_zero_length"] == 1
    halved = make_workload({"name": "burstgpt", "path": path, "time_scale": 0.5}, VOCAB)
    assert offsets_match(halved, [0.0, 56.5, 60.25, 62.5])


def test_burstgpt_filters_by_model_and_log_type(tmp_path):
    path = write(tmp_path, "BurstGPT_1.csv", BURSTGPT)
    chatgpt = make_workload({"name": "burstgpt", "path": path, "model": "ChatGPT",
                             "log_type": "Conversation log"}, VOCAB)  # fmt: skip
    assert shape(chatgpt) == [(472, 18), (97, 61)]
    assert offsets_match(chatgpt, [0.0, 125.0])
    gpt4 = make_workload({"name": "burstgpt", "path": path, "model": "GPT-4"}, VOCAB)
    assert shape(gpt4) == [(417, 388)]


def test_azure_timestamps_with_seven_fractional_digits(tmp_path):
    path = write(tmp_path, "AzureLLMInferenceTrace_conv.csv", AZURE)
    requests = make_workload({"name": "azure_llm", "path": path}, VOCAB)
    assert shape(requests) == [(374, 44), (396, 109), (879, 6), (1020, 201)]
    # 18:15:46.6805900 -> 18:15:50.9951690: 4.3145790 s; -> 23:59:59.9999999: 5 h 44 min
    # 13.3194099 s = 20653.3194099 s; across midnight to 00:00:01.0000001: 1.0000002 s more
    assert offsets_match(requests, [0.0, 4.314579, 20653.3194099, 20654.3194101])
    fast = make_workload({"name": "azure_llm", "path": path, "time_scale": 0.001}, VOCAB)
    assert offsets_match(fast, [0.0, 0.004314579, 20.6533194099, 20.6543194101])
    assert abs(fast[1].arrival_time - 0.0043145790) < 1e-9  # 100 ns ticks survive the epoch


def test_azure_2024_timestamps_with_a_zone(tmp_path):
    text = ("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00.009930+00:00,4808,10\n"
            "2024-05-10 00:00:00.512000+00:00,3180,8\n")  # fmt: skip
    requests = make_workload({"name": "azure_llm", "path": write(tmp_path, "a.csv", text)}, VOCAB)
    assert shape(requests) == [(4808, 10), (3180, 8)]
    assert offsets_match(requests, [0.0, 0.50207])


def test_mooncake_lengths_offsets_and_shared_blocks(tmp_path):
    path = write(tmp_path, "conversation_trace.jsonl", jsonl(MOONCAKE))
    requests = make_workload({"name": "mooncake", "path": path}, VOCAB)
    assert shape(requests) == [(6755, 500), (7319, 490), (7234, 794)]
    assert offsets_match(requests, [0.0, 0.0, 3.052])
    first, second, third = (r.prompt_token_ids for r in requests)
    # hash id 0 is each prompt's first 512-token block; nothing after it is shared
    assert first[:512] == second[:512] == third[:512]
    assert first[512:1024] != second[512:1024] != third[512:1024]
    # the same trace and seed give the same tokens; another seed other tokens
    again = make_workload({"name": "mooncake", "path": path}, VOCAB)
    assert [r.prompt_token_ids for r in again] == [first, second, third]
    other = make_workload({"name": "mooncake", "path": path, "seed": 1}, VOCAB)
    assert other[0].prompt_token_ids[:512] != first[:512]


def test_mooncake_block_size_is_the_traces(tmp_path):
    lines = [{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [7, 8, 9]},
             {"timestamp": 10, "input_length": 45, "output_length": 2, "hash_ids": [7, 8, 5]}]  # fmt: skip
    path = write(tmp_path, "t.jsonl", jsonl(lines))
    a, b = make_workload({"name": "mooncake", "path": path, "block_size": 16}, VOCAB)
    assert a.prompt_token_ids[:32] == b.prompt_token_ids[:32]  # ids 7 and 8: 2 x 16 tokens
    assert a.prompt_token_ids[32:] != b.prompt_token_ids[32:]


def test_sharegpt_turns_with_their_history(tmp_path):
    path = write(tmp_path, "sg.json", json.dumps(SHAREGPT, indent=1))
    requests = make_workload({"name": "sharegpt", "path": path}, VOCAB)
    # turn 2's prompt: 6 + 5 history + 3; the second chat's "Hi" (gpt) is history
    assert shape(requests) == [(6, 5), (14, 4), (4, 1)]
    first, second, _ = requests
    assert second.prompt_token_ids[:6] == first.prompt_token_ids  # the history is a prefix
    assert all(r.arrival_time == 0.0 for r in requests)
    assert shape(make_workload({"name": "sharegpt", "path": path, "turns": 1}, VOCAB)) == [
        (6, 5), (4, 1)]  # fmt: skip
    assert shape(make_workload({"name": "sharegpt", "path": path, "first_row": 1}, VOCAB)) == [
        (4, 1)]  # fmt: skip


def test_sharegpt_closed_loop_sends_later_turns_after_the_reply(tmp_path):
    path = write(tmp_path, "sg.json", json.dumps(SHAREGPT))
    requests = make_workload({"name": "sharegpt", "path": path, "closed_loop": True,
                              "think_time": 0.5}, VOCAB)  # fmt: skip
    follow = [r for r in requests if r.after]
    assert len(requests) == 3 and len(follow) == 1
    assert follow[0].after == "sharegpt-0-0" and follow[0].continues
    assert len(follow[0].prompt_token_ids) == 3 and follow[0].arrival_time == 0.5


def test_sharegpt_with_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ["[UNK]", "Hello", ",", "who", "are", "you", "?", "I", "am", "a", "model", "."]
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    path = write(tmp_path, "sg.json", json.dumps(SHAREGPT[:1]))
    requests = make_workload({"name": "sharegpt", "path": path, "tokenizer": str(tmp_path),
                              "turns": 1}, VOCAB)  # fmt: skip
    assert requests[0].prompt_token_ids == [1, 2, 3, 4, 5, 6] and requests[0].params.max_tokens == 5
    assert requests.source["tokenized_by"] == str(tmp_path / "tokenizer.json")


# -- the common options


def azure_rows(n: int) -> str:
    """n rows, one every 250 ms, lengths 100 + i and 10 + i."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{10 + i // 4:02d}.{(i % 4) * 25:02d}00000,{100 + i},{10 + i}"
              for i in range(n)]  # fmt: skip
    return "\n".join(lines) + "\n"


def test_time_window_row_range_and_num_requests(tmp_path):
    path = write(tmp_path, "a.csv", azure_rows(20))
    window = make_workload({"name": "azure_llm", "path": path, "start_time": 1.0,
                            "end_time": 2.0}, VOCAB)  # fmt: skip
    assert [len(r.prompt_token_ids) for r in window] == [104, 105, 106, 107]  # rows at 1.0-1.75 s
    assert offsets_match(window, [0.0, 0.25, 0.5, 0.75])
    rows = make_workload({"name": "azure_llm", "path": path, "first_row": 3,
                          "num_requests": 5}, VOCAB)  # fmt: skip
    assert [len(r.prompt_token_ids) for r in rows] == [103, 104, 105, 106, 107]


def test_rate_rescale_stretches_to_the_mean_rate(tmp_path):
    path = write(tmp_path, "a.csv", azure_rows(9))  # 9 rows over 2 s: 4 per second
    slow = make_workload({"name": "azure_llm", "path": path, "rate": 1.0}, VOCAB)
    assert offsets_match(slow, [float(i) for i in range(9)])  # the last at (9 - 1) / 1 s
    assert slow.source["time_scale"] == pytest.approx(4.0)
    with pytest.raises(ConfigError, match="give rate or time_scale, not both"):
        make_workload({"name": "azure_llm", "path": path, "rate": 1.0, "time_scale": 2.0}, VOCAB)


def test_length_caps_are_counted(tmp_path):
    path = write(tmp_path, "a.csv", azure_rows(10))  # prompts 100..109, outputs 10..19
    capped = make_workload({"name": "azure_llm", "path": path, "max_input_len": 105,
                            "max_output_len": 12}, VOCAB)  # fmt: skip
    assert [len(r.prompt_token_ids) for r in capped] == [100, 101, 102, 103, 104, 105, 105, 105,
                                                         105, 105]  # fmt: skip
    assert [r.params.max_tokens for r in capped] == [10, 11, 12, 12, 12, 12, 12, 12, 12, 12]
    assert capped.source["capped_input"] == 4 and capped.source["capped_output"] == 7
    # the engine's limit caps too: prompt <= max_model_len - 1, then the output in the room left
    engine = make_workload({"name": "azure_llm", "path": path}, VOCAB, max_model_len=112)
    assert shape(engine)[-1] == (109, 3) and engine.source["capped_output"] == 8


def test_the_seed_draws_the_prompt_tokens_and_the_source_names_the_file(tmp_path):
    path = write(tmp_path, "BurstGPT_1.csv", BURSTGPT)
    a = make_workload({"name": "burstgpt", "path": path, "seed": 0}, VOCAB)
    b = make_workload({"name": "burstgpt", "path": path, "seed": 1}, VOCAB)
    assert shape(a) == shape(b) and a[0].prompt_token_ids != b[0].prompt_token_ids
    digest = hashlib.sha256((tmp_path / "BurstGPT_1.csv").read_bytes()).hexdigest()
    assert a.source["sha256"] == digest and a.source["file"] == "BurstGPT_1.csv"
    assert a.source["trace"] == "burstgpt" and a.source["requests"] == 4


# -- bad files: one line naming the file, the line and the problem

BAD = [
    ("burstgpt", "b.csv",
     "Timestamp,Model,Request tokens,Total tokens,Log Type\n5,ChatGPT,472,490,API log\n",
     ":1: missing column 'Response tokens'"),
    ("burstgpt", "b.csv", BURSTGPT.replace("417,388", "417,lots"),
     ":4: Response tokens is not a whole number: 'lots'"),
    ("burstgpt", "b.csv", BURSTGPT.replace("118,GPT-4", "noon,GPT-4"),
     ":4: Timestamp is not a time >= 0: 'noon'"),
    ("azure_llm", "a.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,374\n",
     ":1: missing column 'GeneratedTokens'"),
    ("azure_llm", "a.csv", AZURE.replace("396,109", "3.5e,109"),
     ":3: ContextTokens is not a whole number: '3.5e'"),
    ("azure_llm", "a.csv", AZURE.replace("2023-11-16 18:15:50.9951690", "16/11/2023 18:15:50"),
     ":3: TIMESTAMP is not a date-time like 2023-11-16 18:15:46.6805900: '16/11/2023 18:15:50'"),
    ("azure_llm", "a.csv", AZURE.replace("2023-11-16 18:15:50", "2023-11-31 18:15:50"),
     ":3: TIMESTAMP is not a date-time"),
    ("mooncake", "m.jsonl", jsonl([{"timestamp": 0, "input_length": 5, "output_length": 1}]),
     ":1: missing key 'hash_ids'"),
    ("mooncake", "m.jsonl", jsonl(MOONCAKE[:1] + [{**MOONCAKE[1], "input_length": "long"}]),
     ":2: input_length is not a whole number: 'long'"),
    ("mooncake", "m.jsonl", jsonl(MOONCAKE[:2] + [{**MOONCAKE[2], "timestamp": "3s"}]),
     ":3: timestamp is not a time >= 0: '3s'"),
    ("sharegpt", "s.json", '[\n {"id": "a", "conversations": [{"from": "human"}]}\n]\n',
     ":2: a conversation must be"),
    ("sharegpt", "s.json", '[\n {"id": "a", "conversations": []},\n {"id": \n]\n',
     ":4: not valid JSON"),
]  # fmt: skip


@pytest.mark.parametrize("name,filename,text,problem", BAD)
def test_a_bad_file_is_one_line_naming_file_line_and_problem(tmp_path, name, filename, text,
                                                              problem):  # fmt: skip
    path = write(tmp_path, filename, text)
    with pytest.raises(ConfigError) as err:
        make_workload({"name": name, "path": path}, VOCAB)
    message = str(err.value)
    assert message.startswith(path + problem) and "\n" not in message


def test_a_missing_path_or_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="workload mooncake needs `path`"):
        make_workload({"name": "mooncake"}, VOCAB)
    with pytest.raises(ConfigError, match="no such file"):
        make_workload({"name": "azure_llm", "path": str(tmp_path / "none.csv")}, VOCAB)
