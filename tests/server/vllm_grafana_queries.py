"""The PromQL of vLLM's published Grafana dashboard, extracted once, as test data for
test_metrics_vllm.py: under `serve --metrics-namespace vllm`, every metric these queries read must
exist with every label they filter or aggregate on.

Source: github.com/vllm-project/vllm, examples/observability/prometheus_grafana/grafana.json at
commit 4b5c627c23e6690b8987100d1cbf78e34ac14bf9 (each panel target's "expr", in panel order).
The dashboard's one query variable is `$model_name` (label_values(model_name)); Grafana's
`$__rate_interval` is a range.
"""

SOURCE = "vllm-project/vllm:examples/observability/prometheus_grafana/grafana.json"
COMMIT = "4b5c627c23e6690b8987100d1cbf78e34ac14bf9"
VARIABLES = {"$model_name": "model_name", "$__rate_interval": None}  # variable -> the label it ranges over

QUERIES = [
    # E2E Request Latency
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.95, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.5, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    (
        'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
        'rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])'
    ),
    # Token Throughput
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    # Inter Token Latency
    'histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.95, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.5, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    (
        'rate(vllm:inter_token_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
        'rate(vllm:inter_token_latency_seconds_count{model_name="$model_name"}[$__rate_interval])'
    ),
    # Scheduler State
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    # Time To First Token Latency
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.95, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.5, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    (
        'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
        'rate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])'
    ),
    # Cache Utilization
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    # Request Prompt Length, Request Generation Length (heatmaps)
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    # Finish Reason
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    # Queue Time
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    # Requests Prefill and Decode Time
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    # Max Generation Token in Sequence Group
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
]
