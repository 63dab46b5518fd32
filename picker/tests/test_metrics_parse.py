import pytest

from picker.signals.metrics import MetricsParseError, parse_vllm_metrics

from helpers import metrics_text


def test_parses_load_cache_config_and_model():
    m = parse_vllm_metrics(metrics_text(waiting=3, running=7, kv=0.42, block_size=16, num_blocks=4321))
    assert (m.waiting, m.running, m.kv_usage) == (3, 7, 0.42)
    assert m.models == {"qwq"}
    assert (m.block_size, m.num_gpu_blocks) == (16, 4321)
    assert m.kv_capacity_tokens == 16 * 4321


def test_old_kv_name_is_used_when_new_one_is_absent():
    assert parse_vllm_metrics(metrics_text(kv=0.7, old_kv_name=True)).kv_usage == 0.7


def test_lookalike_family_names_are_not_confused():
    extra = 'vllm:num_requests_waiting_by_reason{model_name="qwq",reason="capacity"} 99\n'
    assert parse_vllm_metrics(metrics_text(waiting=2, extra=extra)).waiting == 2


def test_lora_newest_series_wins():
    text = metrics_text() + (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 10\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 20\n')
    m = parse_vllm_metrics(text)
    assert m.lora_max == 4
    assert m.lora_running == {"a", "b"} and m.lora_waiting == {"c"}
    assert m.models == {"qwq"}  # lora_requests_info has no model_name


def test_two_engines_sum_queues_and_take_max_kv():
    text = metrics_text(waiting=1, running=2, kv=0.2) + (
        'vllm:num_requests_waiting{engine="1",model_name="qwq"} 4\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="qwq"} 0.9\n')
    m = parse_vllm_metrics(text)
    assert m.waiting == 5 and m.kv_usage == 0.9


@pytest.mark.parametrize("text", ["", "# nothing here\n", "garbage{ 1\n", "vllm:num_requests_waiting{model_name=\"a\"} abc\n"])
def test_unusable_text_raises(text):
    with pytest.raises(MetricsParseError):
        parse_vllm_metrics(text)


def test_label_escapes_spaces_and_timestamps():
    text = ('vllm:num_requests_waiting{model_name="a\\"b\\\\c d",engine="0"} 3 1700000000000\n'
            'vllm:num_requests_running 2\n')
    m = parse_vllm_metrics(text)
    assert m.models == {'a"b\\c d'} and (m.waiting, m.running) == (3, 2)


def test_sim_style_page_with_both_kv_names_prefers_the_new_one():
    text = metrics_text(kv=0.25) + 'vllm:gpu_cache_usage_perc{engine="0",model_name="qwq"} 0.99\n'
    assert parse_vllm_metrics(text).kv_usage == 0.25
