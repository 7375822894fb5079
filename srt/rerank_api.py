"""SGLang's POST /v1/rerank, on a cross-encoder served with `--is-embedding` (a
BertForSequenceClassification: model_executor/models/bert.py).

Each document becomes one pair with the query, `[CLS] query [SEP] document [SEP]` as the model's
tokenizer encodes a pair, and one request asking for no new token: it goes through the same
broadcast, scheduler and batches as a generation, and its score comes back where an embedding
would. The answer is SGLang's: a list of `{"score", "document", "index"}` (with `meta_info`),
highest score first, the first `top_n`. A query holding the tokenizer's [SEP] token is refused (the
model reads the document's tokens as those after the first [SEP]).

Fields: SGLang's `V1RerankReqInput` (sglang 0.5.23), in srt/request_fields.py's kinds.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from srt.embeddings_api import embed_outputs
from srt.generate_parse import RequestError, check_request_fields, is_int
from srt.http_common import NATIVE_ERRORS, manager, read_json_object
from srt.request_fields import Field, advisory, impl, off
from srt.request_state import ServiceUnavailableError

router = APIRouter()

RERANK: dict[str, Field] = {
    "query": impl(),
    "documents": impl(),
    "top_n": impl(),
    "return_documents": impl(True),
    "instruct": off(None),  # Qwen3 rerankers' instruction: srt serves cross-encoders only
    "model": advisory(),
}


def _texts(body: dict[str, Any]) -> tuple[str, list[str]]:
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str):
        raise RequestError("query must be a string (multimodal content is not served)", "query")
    if not isinstance(documents, list) or not documents or not all(isinstance(d, str) for d in documents):
        raise RequestError("documents must be a non-empty list of strings", "documents")
    top_n = body.get("top_n")
    if top_n is not None and (not is_int(top_n) or top_n < 1):
        raise RequestError(f"top_n must be an integer of at least 1, got {top_n!r}", "top_n")
    if not isinstance(body.get("return_documents", True), bool):
        raise RequestError("return_documents must be true or false", "return_documents")
    return query, documents


@router.post("/v1/rerank")
async def rerank(request: Request) -> Response:
    tm = manager(request)
    try:
        body = await read_json_object(request)
        check_request_fields(body, RERANK)
        query, documents = _texts(body)
        if not tm.model_info.get("cross_encoder"):
            raise RequestError(
                "/v1/rerank needs a cross-encoder (a BertForSequenceClassification served with "
                "--is-embedding); this server's model is not one",
                "query",
            )
        sep = tm.tokenizer.sep_token_id
        if sep in tm.tokenizer(query, add_special_tokens=False)["input_ids"]:
            raise RequestError("query must not hold the tokenizer's separator token", "query")
        pairs = [tm.tokenizer(query, document)["input_ids"] for document in documents]
        outs = await embed_outputs(tm, request, {"input_ids": pairs}, NATIVE_ERRORS, {})
    except (ValueError, ServiceUnavailableError) as error:
        return NATIVE_ERRORS.of(error)
    if isinstance(outs, JSONResponse):
        return outs
    ranked = sorted(range(len(documents)), key=lambda i: -outs[i]["embedding"][0])  # stable on ties
    top_n = body.get("top_n") or len(documents)
    return JSONResponse(
        [
            {
                "score": outs[i]["embedding"][0],
                **({"document": documents[i]} if body.get("return_documents", True) else {}),
                "index": i,
                "meta_info": outs[i]["meta_info"],
            }
            for i in ranked[:top_n]
        ]
    )
