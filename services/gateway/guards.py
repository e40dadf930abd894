"""RequestGuards: what keeps one request within bounds before it reaches the workers.

Handlers call, in this order: `check_fanout` (how many generations the body asks for, refused
with 400 beyond the limit), `admit` (admission control: waits for slots or sheds with 429), then
`encoder` (chat templating and tokenization off the event loop). The body size limit, the body
read deadline and the API key are enforced earlier, by ASGI middleware (body_limit.py, auth.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from services.gateway.admission import AdmissionControl, admit
from services.gateway.choices import until_disconnected
from services.gateway.errors import bad_request
from services.gateway.prompts import PromptEncoder


@dataclass
class RequestGuards:
    """Per-gateway limits and the objects that enforce them; one per app (app.state.guards)."""

    encoder: PromptEncoder
    admission: AdmissionControl
    max_generations: int

    def check_fanout(self, prompts: int, per_prompt: int, prompt_param: str, count_param: str) -> int:
        """The number of generations (prompts x per_prompt); 400 above the limit, naming the field
        that asks for more than one per prompt if any (n, best_of), else the prompts' field."""
        total = prompts * per_prompt
        if total > self.max_generations:
            raise bad_request(f"this request asks for {total} generations ({prompts} prompt(s) x {per_prompt}); "
                              f"the limit is {self.max_generations} per request (--max-generations-per-request)",
                              param=count_param if per_prompt > 1 else prompt_param, code="too_many_generations")
        return total

    async def admit(self, request: Request, model: str, slots: int) -> bool:
        """Wait for admission; False if the client left while waiting. Raises GatewayError(429)."""
        return bool(await until_disconnected(request, lambda: self._admit(request, model, slots)))

    async def _admit(self, request: Request, model: str, slots: int) -> bool:
        await admit(request, self.admission, model, slots)
        return True


def request_guards(request: Request) -> RequestGuards:
    return request.app.state.guards
