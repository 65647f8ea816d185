"""The OpenAI front's one gRPC channel to Triton (docs/openai.md, "How it works"): requests as coroutines, no threads.

The sync client (pipeline.client) opens a channel per call and tritonclient starts a thread to read each stream, so
a front that ran it per request held a thread, a stream thread and a TCP connection for every running request.
Here one `grpc.aio` channel, made on the front's event loop at startup and closed at shutdown, carries every
request as its own `ModelStreamInfer` call (HTTP/2 streams over one connection), or one `ModelInfer` call for a
model served with `triton.decoupled: false`. The request is the protobuf pipeline.client builds (make_inputs,
infer_request) with the door's key metadata, and the replies are read by the same code (pipeline.client.Reading),
so the answer is the one `pipeline.client.generate` gives. tritonclient's own aio client is not used: its stream
refuses the `triton_enable_empty_final_response` parameter the decoupled models end a request with.

Cancelling the coroutine (the HTTP client left), a `cancel()` that says so, or the request's timeout cancel the gRPC
call: Triton sees the cancellation and the model stops decoding the request at its next step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pipeline import door
from pipeline.client import Reading, RequestError, RequestTimeout, infer_request, is_final, make_inputs

CANCEL_TICK_S = 0.2  # how often a waiting stream asks `cancel()` (it is also asked after each response)
CLOSE_S = 5.0  # after the final response, the wait for Triton to end the stream before cancelling it
MAX_MESSAGE = 2**31 - 1  # tritonclient's channel limits (Triton's own)
RECONNECT_MS = 1000


class TritonChannel:
    """One grpc.aio channel to Triton's gRPC port, shared by every request of the front (make it on the loop)."""

    def __init__(self, url: str):
        import grpc  # lazy: only the front's process talks to Triton this way
        from tritonclient.grpc import service_pb2, service_pb2_grpc  # lazy: the front alone (CLI imports this)

        self.url, self.pb = url, service_pb2
        # A channel that lost Triton (a restart) reconnects within RECONNECT_MS, not after gRPC's backoff of up to two
        # minutes: the per-call channels this replaces connected afresh for every request.
        self.channel = grpc.aio.insecure_channel(url, options=[("grpc.max_send_message_length", MAX_MESSAGE),
                                                               ("grpc.max_receive_message_length", MAX_MESSAGE),
                                                               ("grpc.initial_reconnect_backoff_ms", RECONNECT_MS),
                                                               ("grpc.min_reconnect_backoff_ms", RECONNECT_MS),
                                                               ("grpc.max_reconnect_backoff_ms", RECONNECT_MS)])
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    async def close(self) -> None:
        """Close the channel; calls still running are cancelled."""
        await self.channel.close()

    @staticmethod
    def _metadata() -> tuple:
        headers = door.grpc_headers()
        return tuple(headers.items()) if headers else ()

    async def ready(self, model: str, timeout: float = 2.0) -> bool:
        """Triton is ready and so is `model` (the front's /health)."""
        import grpc  # lazy: the front alone (CLI imports this)

        md = self._metadata()
        try:
            server = await self.stub.ServerReady(self.pb.ServerReadyRequest(), metadata=md, timeout=timeout)
            if not server.ready:
                return False
            return bool((await self.stub.ModelReady(self.pb.ModelReadyRequest(name=model), metadata=md,
                                                    timeout=timeout)).ready)
        except grpc.RpcError:  # not reachable is not ready
            return False

    async def generate(self, model: str, prompt: str | bytes, max_tokens: int, method: str | None = None,
                       stream: bool = False, timeout: float = 300.0, on_piece: Callable[[str], None] | None = None,
                       unary: bool = False, request_id: str = "", cancel: Callable[[], bool] | None = None,
                       **opts) -> dict:
        """pipeline.client.generate on this channel, as a coroutine: the same request, the same answer (a dict with
        text, pieces, perf outputs, latency_s, ttft_s); RequestError / RequestTimeout as it raises them."""
        import grpc  # lazy: the front alone (CLI imports this)
        from tritonclient.grpc import InferResult  # lazy: the front alone (CLI imports this)

        reading = Reading(method, on_piece)
        inputs = make_inputs(prompt, max_tokens, method=method, stream=stream, **opts)
        request = infer_request(model, inputs, request_id, stream=not unary)
        if unary:
            try:
                reply = await self.stub.ModelInfer(request, metadata=self._metadata(), timeout=timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise RequestTimeout(f"no response from {model} within {timeout:.0f}s") from None
                raise RequestError(e.details() or str(e.code())) from None
            result = InferResult(reply)
            reading.seen(result)
            return reading.outcome([result], True)
        responses, complete = await self._stream(model, request, timeout, reading, cancel)
        return reading.outcome(responses, complete)

    async def _stream(self, model: str, request, timeout: float, reading: Reading,
                      cancel: Callable[[], bool] | None) -> tuple[list, bool]:
        """One ModelStreamInfer call carrying `request`: its results until the final flag, (responses, complete).
        Any way out before the final response (an error, the timeout, `cancel()`, this coroutine cancelled)
        cancels the call."""
        import grpc  # lazy: the front alone (CLI imports this)
        from tritonclient.grpc import InferResult  # lazy: the front alone (CLI imports this)

        call = self.stub.ModelStreamInfer(metadata=self._metadata())
        responses: list = []
        complete = ended = False  # ended: Triton answered the request (its final response, or its error)
        deadline = time.monotonic() + timeout
        reader: asyncio.Future | None = None
        try:
            await call.write(request)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestTimeout(f"no final response from {model} within {timeout:.0f}s")
                if reader is None:
                    reader = asyncio.ensure_future(call.read())
                done, _ = await asyncio.wait({reader}, timeout=min(left, CANCEL_TICK_S) if cancel else left)
                if not done:
                    if cancel and cancel():
                        break
                    continue
                reply, reader = reader.result(), None
                if reply is grpc.aio.EOF:
                    raise RequestError(f"Triton ended the stream to {model} before the request's final response")
                if reply.error_message:
                    ended = True
                    raise RequestError(reply.error_message)
                if reply.infer_response.outputs:
                    result = InferResult(reply.infer_response)
                    responses.append(result)
                    reading.seen(result)
                if is_final(reply.infer_response):
                    complete = ended = True
                    break
                if cancel and cancel():
                    break
        except grpc.aio.AioRpcError as e:  # the call failed: Triton unreachable, the key refused, the server gone
            raise RequestError(e.details() or str(e.code())) from None
        finally:
            if reader is not None and not reader.done():
                reader.cancel()
            if ended:
                await self._end(call)
            else:
                call.cancel()  # Triton sees the cancellation: the model stops decoding the request at its next step
        return responses, complete

    @staticmethod
    async def _end(call) -> None:
        """After Triton answered the request: say no more requests come and let Triton end the stream (it cancels
        nothing), or cancel it if Triton does not within CLOSE_S."""
        import grpc  # lazy: the front alone (CLI imports this)

        try:
            await asyncio.wait_for(_drain(call), CLOSE_S)
        except (TimeoutError, grpc.aio.AioRpcError):
            call.cancel()


async def _drain(call) -> None:
    import grpc  # lazy: the front alone (CLI imports this)

    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass
