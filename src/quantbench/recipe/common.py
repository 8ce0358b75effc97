"""What the recipe schema (recipe/__init__.py) and the method specs (recipe/methods.py) both build
on, so that neither imports the other's module to get it: `Strict`, the base of every settings
schema (recipes, suites, profiles, policies, sweeps, stacks), which refuses a key it does not know
by name; and the text a recipe calibrates or trains on unless it names another."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

DEFAULT_TEXT = "builtin:python-docs"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
