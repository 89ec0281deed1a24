"""``deepinfer chat``: an interactive loop that streams reasoning and answer tokens as they are generated."""

from __future__ import annotations

import sys
from dataclasses import replace

from deepinfer.chat.parsing import StreamingChatParser
from deepinfer.chat.prompt import chat_prompt
from deepinfer.config.engine import EngineArgs
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.sampling import SamplingParams

DIM, RESET = "\033[2m", "\033[0m"


def stream_turn(engine: LLMEngine, request_id: str, messages: list[dict], params: SamplingParams, thinking: bool,
                out=sys.stdout) -> str:
    """Generate one assistant turn, printing deltas as they arrive; returns the answer text."""
    engine.add_request(request_id, chat_prompt(engine.tokenizer, messages, thinking=thinking),
                       replace(params, skip_special_tokens=False))
    parser, answer = StreamingChatParser(thinking=thinking), []
    done = False
    while not done:
        for o in engine.step():
            if o.request_id != request_id:
                continue
            deltas = parser.feed(o.delta_text[0])
            if o.finished:
                deltas += parser.finish()
                done = True
            for d in deltas:
                if d.reasoning:
                    out.write(DIM + d.reasoning + RESET)
                if d.content:
                    out.write(d.content)
                    answer.append(d.content)
                if d.tool_call:
                    out.write(f"\n[tool call] {d.tool_call.name}({d.tool_call.arguments})")
            out.flush()
    out.write("\n")
    return "".join(answer)


def run_chat(args: EngineArgs, params: SamplingParams, thinking: bool = False, system: str | None = None) -> int:
    engine = LLMEngine.from_engine_args(args)
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    print("deepinfer chat — empty line or Ctrl-D to quit.")
    turn = 0
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        answer = stream_turn(engine, f"chat-{turn}", messages, params, thinking)
        messages.append({"role": "assistant", "content": answer})
        turn += 1
    return 0
