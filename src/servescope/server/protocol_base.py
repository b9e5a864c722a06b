"""What every request model shares: strict types, no NaN/Infinity, unknown keys forbidden."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Strict

Float = Annotated[float, Strict()]  # ints are accepted, strings and booleans are not


class Base(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
