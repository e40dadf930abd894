"""Worker gRPC statuses become OpenAI-style HTTP errors: the client's mistakes are 4xx, the
deployment's are named 5xx; only a status nobody expects is a 500."""

import grpc

from services.gateway.errors import status_for_grpc


def test_a_prefill_and_decode_that_refuse_each_other_are_a_named_503_not_a_500():
    # e.g. "speculative decoding config mismatch (prefill vs decode): speculative_algorithm ..."
    assert status_for_grpc(grpc.StatusCode.FAILED_PRECONDITION) == (503, "workers_disagree")


def test_client_mistakes_are_4xx_and_an_unexpected_status_is_500():
    assert status_for_grpc(grpc.StatusCode.INVALID_ARGUMENT)[0] == 400
    assert status_for_grpc(grpc.StatusCode.NOT_FOUND)[0] == 404
    assert status_for_grpc(grpc.StatusCode.DATA_LOSS) == (500, "worker_error")
