import pytest

from protocol.sampling_params import InvalidParam, SamplingParams
from runtime.config import ServerArgs


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
    ],
)
def test_bad_env_names_the_setting(env, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs.from_env(env)


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
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
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
