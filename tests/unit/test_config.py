"""Server arguments: flags and environment agree; each setting is described once, on its
ServerArgs field, and every other layer (the scheduler's and the model runner's configs, the
README's table, --help) takes its default and description from there; sampling parameters
name the one that is bad."""

import dataclasses
import inspect
import io
import tokenize
from pathlib import Path

import pytest

from gpu.attention import BACKENDS
from gpu.model_runner import DEFAULT_MEM_FRACTION, KV_CACHE_DTYPES, ModelRunnerConfig
from protocol.sampling_params import InvalidParam, SamplingParams
from runtime import settings
from runtime.config import DESCRIPTION, PROG, ServerArgs, readme_with_settings
from runtime.scheduler.config import SchedulerConfig
from runtime.scheduler.runner import runner_config

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = list(settings.settings_of(ServerArgs))
NAMES = {f.name for f, _ in SETTINGS}


def test_cli_and_env_agree():
    args = ServerArgs.from_cli(
        ["--max-running-requests", "8", "--disable-radix-cache", "--schedule-policy", "lpm", "--api-key", "k"]
    )
    assert args.max_running_requests == 8 and args.disable_radix_cache and args.api_key == "k"
    assert ServerArgs.from_env(args.to_env()) == args


@pytest.mark.parametrize(
    "env,match",
    [
        ({"RINGSERVE_PORT": "x"}, "RINGSERVE_PORT"),
        ({"RINGSERVE_SCHEDULE_POLICY": "random"}, "schedule-policy"),
        ({"RINGSERVE_WORKERS": "0"}, "workers"),
        ({"RINGSERVE_CHAT_TEMPLATE": "no-such-file.jinja"}, "chat-template"),
        ({"RINGSERVE_LORA_TARGET_MODULES": "q_proj"}, "lora-target-modules and .* need --enable-lora"),
        ({"RINGSERVE_ENABLE_LORA": "1", "RINGSERVE_LORA_TARGET_MODULES": "q_proj,mlp"}, "'mlp' is not a module"),
    ],
)
def test_bad_env_names_the_setting(env, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs.from_env(env)


def test_readme_table_is_generated():
    readme = (ROOT / "README.md").read_text()
    assert readme_with_settings(readme) == readme, "regenerate it: python -m runtime.config --readme README.md"


@dataclasses.dataclass(frozen=True)
class Toy:
    size: int = settings.setting(4, "how many", unit="s", aliases=("count",), at_least=1)
    on: bool = settings.setting(False, "whether", same_row=True)
    mode: str = settings.setting("a", "`a` or `b`", choices=("a", "b"))


def test_table_rows_and_where_they_go():
    table = settings.markdown_table(Toy)
    assert table.splitlines()[2:] == [
        "| `--size` (`--count`), `--on` | 4 s, off | how many; `--on`: whether |",
        "| `--mode` | `a` | `a` or `b` |",
    ]
    doc = "# Toy\n\n## Settings\n\nIntro.\n\n| old |\n|---|\n\nAfter.\n"
    assert settings.with_table(doc, table, "## Settings") == f"# Toy\n\n## Settings\n\nIntro.\n\n{table}\nAfter.\n"


def test_toy_settings_parse_and_check():
    assert Toy(**settings.parse_cli(Toy, ["--count", "3", "--on"], "toy", "")) == Toy(size=3, on=True)
    assert Toy(**settings.read_env(Toy, {"RINGSERVE_COUNT": "3", "RINGSERVE_ON": "1"})) == Toy(size=3, on=True)
    with pytest.raises(ValueError, match="--count 3 and --size 2 conflict"):
        settings.parse_cli(Toy, ["--size", "2", "--count", "3"], "toy", "")
    for bad, match in (
        ({"size": 0}, "--size must be at least 1"),
        ({"mode": "c"}, r"--mode must be one of \['a', 'b'\]"),
    ):
        with pytest.raises(ValueError, match=match):
            settings.check(Toy(**bad))


def test_help_shows_each_setting_with_its_default():
    shown = "".join(settings.parser(ServerArgs, PROG, DESCRIPTION).format_help().split())
    for f, s in SETTINGS:
        line = settings.help_line(f, s).replace("%%", "%")
        assert settings.flag(f.name) in shown and "".join(line.split()) in shown, f.name


def _comment_lines(cls: type) -> set[int]:
    """The lines of `cls`'s source (1: its first) holding a comment."""
    source = inspect.getsource(cls)
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0] for t in tokens if t.type == tokenize.COMMENT}


def _field_lines(cls: type) -> dict[str, int]:
    lines = inspect.getsource(cls).splitlines()
    return {
        name: i
        for i, line in enumerate(lines, 1)
        for name in [line.strip().partition(":")[0]]
        if name in {f.name for f in dataclasses.fields(cls)}
    }


@pytest.mark.parametrize("cls", [ServerArgs, SchedulerConfig, ModelRunnerConfig])
def test_no_setting_is_described_twice(cls):
    """What a setting does is its help text, never also a comment: not in ServerArgs, nor beside
    (or right above) a field of another config that holds the setting of the same name."""
    comments = _comment_lines(cls)
    for name, line in _field_lines(cls).items():
        if name in NAMES:
            assert line not in comments and line - 1 not in comments, f"{cls.__name__}.{name}: a comment describes it"
    helps = [s.help for _, s in SETTINGS]
    assert len(set(helps)) == len(helps)


def test_docs_name_each_choice_and_default():
    for f, s in SETTINGS:
        said = f"{s.help} {settings.default_words(f, s)}"
        for choice in s.choices:
            assert f"`{choice}`" in said, f"--{f.name}: its help does not name `{choice}`"
        if f.default is not None and f.default != ():
            value = settings.default_words(f, dataclasses.replace(s, default_text=None))
            assert value.split()[0] in said, f"--{f.name}: its default text does not say {value}"


@pytest.mark.parametrize("cls", [SchedulerConfig, ModelRunnerConfig])
def test_defaults_agree_between_layers(cls):
    """A config field named as a setting defaults to the setting's default (the scheduler's
    context_length, the model's once loaded, has none)."""
    for f in dataclasses.fields(cls):
        if f.name in NAMES and f.default is not dataclasses.MISSING:
            assert f.default == ServerArgs.__dataclass_fields__[f.name].default, f"{cls.__name__}.{f.name}"


def test_configs_copy_every_setting_by_name():
    args = ServerArgs(
        max_running_requests=7,
        chunked_prefill_size=99,
        max_prefill_tokens=123,
        schedule_policy="lpm",
        disable_radix_cache=True,
        grammar_backend="none",
        constrained_json_any_whitespace=True,
        speculative_algorithm="none",
        speculative_num_draft_tokens=3,
        speculative_ngram_min_match_window_size=2,
        speculative_ngram_max_match_window_size=5,
        page_size=8,
        max_total_tokens=512,
        dtype="float32",
        quantization="none",
        kv_cache_dtype="bfloat16",
        random_seed=9,
    )
    for config in (SchedulerConfig.from_server_args(args, 100), runner_config(args)):
        for f in dataclasses.fields(config):
            if f.name in NAMES and f.name != "context_length" or isinstance(config, ModelRunnerConfig):
                assert getattr(config, f.name) == getattr(args, f.name), f.name
    assert SchedulerConfig.from_server_args(args, 100, init_new_token_ratio=0.5).init_new_token_ratio == 0.5


def test_choices_agree_with_the_layer_that_acts_on_them():
    fields = ServerArgs.__dataclass_fields__
    assert fields["kv_cache_dtype"].metadata["setting"].choices == ("auto", *KV_CACHE_DTYPES)
    assert set(fields["attention_backend"].metadata["setting"].choices) == set(BACKENDS)
    mem = fields["mem_fraction_static"].metadata["setting"].default_text
    assert all(f"{value} {device.upper()}" in mem for device, value in DEFAULT_MEM_FRACTION.items())


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"max_new_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 in float32: the sampler would divide by it
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"min_new_tokens": 20, "max_new_tokens": 10}, "min_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (50000,)}, "stop_token_ids"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 49153}, "top_logprobs"),  # past the vocabulary
        ({"prompt_logprobs": 49153}, "prompt_logprobs"),
    ],
)
def test_sampling_params_name_the_bad_param(kwargs, param):
    with pytest.raises(InvalidParam) as err:
        SamplingParams(**kwargs).validate(vocab_size=49152)
    assert err.value.param == param


def test_sampling_params_defaults_are_valid():
    assert SamplingParams().validate(vocab_size=10) == SamplingParams()
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-320).greedy and not SamplingParams(temperature=1e-5).greedy
