"""Request and response bodies of tool calling and of `response_format` (OpenAI's shapes).

Kept beside `http_protocol` (which uses them as field types) so the tool-calling
API reads in one place: what a client sends (`Tool`, `NamedToolChoice`,
`ResponseFormat`, assistant `ToolCall`s in the history) and what the server
answers (`ToolCall` in a message, `DeltaToolCall` in a stream chunk).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class FunctionDefinition(_In):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema; none: any object
    strict: Optional[bool] = None


class Tool(_In):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_In):
    name: str


class NamedToolChoice(_In):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_In):
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_In):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(BaseModel):
    """One tool call's piece of a stream chunk: the first piece carries id, type and name,
    the later ones more of the arguments text."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None
