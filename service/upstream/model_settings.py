"""A model's own request settings (`models.<key>.system_prompt` and `.params`), applied the same way to
live, shadow and noise-floor calls, so that two entries naming one upstream model with different
settings can be a route's stable and candidate."""

from __future__ import annotations

from service.config import ModelConfig

# The fields that cap an answer's length; the first one a request sets is its cap.
CAP_FIELDS = ("max_completion_tokens", "max_tokens")


def model_body(request: dict, model: ModelConfig) -> dict:
    """The request as `model` gets it: its upstream name, its system prompt before the client's
    messages, its params over the client's fields (a cap in params replaces the client's cap in
    either field). `request` itself is left as it was."""
    if not model.params and model.system_prompt is None:
        return {**request, "model": model.name}
    params_cap = any(field in model.params for field in CAP_FIELDS)
    body = {k: v for k, v in request.items() if not (params_cap and k in CAP_FIELDS)}
    body.update(model.params)
    body["model"] = model.name
    if model.system_prompt is not None:
        messages = request.get("messages")
        body["messages"] = [{"role": "system", "content": model.system_prompt},
                            *(messages if isinstance(messages, list) else ())]
    return body


def requested_cap(request: dict) -> int | None:
    """The answer length a request allows, from its first cap field; None when it sets none."""
    for field in CAP_FIELDS:
        value = request.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def settings_record(model: ModelConfig) -> dict:
    """What an evaluation's `repro` keeps of a model's settings."""
    return {"upstream": model.name, "system_prompt": model.system_prompt, "params": dict(model.params)}
