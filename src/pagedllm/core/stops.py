"""The stop rule on token ids: whether a sampled token finishes its request (stop
strings are matched on text, in the engine)."""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.core.request import Request, RequestStatus


def stop_status(
    request: Request, token_id: int, max_tokens: Callable[[Request], int], max_model_len: int
) -> RequestStatus | None:
    """How ``request`` finishes now that ``token_id`` was appended to it (None: it goes
    on). A stop token id is recorded in ``stop_reason``."""
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if params is None:
        if token_id == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
    elif num_output >= params.min_tokens:
        if not params.ignore_eos and token_id == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if num_output >= max_tokens(request) or len(request.all_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
