"""Twenty pydantic models the structured-output e2e tests hand to `client.chat.completions.parse`:
nested objects, arrays with minItems/maxItems, string and integer enums, anyOf with null, unions
of objects, string lengths and patterns, integer ranges (inclusive and exclusive), a number range,
a tuple and a constant.

The tiny presets' weights are random, so their answers are whatever the grammar lets through. Every
string, array and nesting is bounded so that any answer the grammar allows ends well inside the
tests' max_tokens: an unbounded string lets a random model write until the budget runs out.
"""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

Short = Annotated[str, Field(min_length=1, max_length=12)]
Word = Annotated[str, Field(min_length=3, max_length=8)]
Digit = Annotated[int, Field(ge=0, le=9)]


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Priority(IntEnum):
    low = 1
    mid = 2
    high = 3


class Address(BaseModel):
    city: Short
    zip_code: Annotated[str, Field(pattern=r"^[0-9]{5}$")]


class Person(BaseModel):  # nested object, string lengths, integer range, a pattern
    name: Short
    age: Annotated[int, Field(ge=0, le=120)]
    address: Address


class Palette(BaseModel):  # enums, a bounded array of them
    colors: Annotated[list[Color], Field(min_length=1, max_length=3)]
    favourite: Color


class MaybeNote(BaseModel):  # anyOf with null
    note: Short | None
    score: Annotated[int, Field(ge=-5, le=5)] | None


class Inventory(BaseModel):  # an array of bounded strings, a boolean
    items: Annotated[list[Annotated[str, Field(max_length=6)]], Field(max_length=2)]
    count: Annotated[int, Field(ge=0, le=99)]
    in_stock: bool


class Order(BaseModel):  # a literal, an array of objects, an optional nested object
    kind: Literal["buy", "sell"]
    lines: Annotated[list[Inventory], Field(min_length=1, max_length=2)]
    buyer: Person | None


class Flag(BaseModel):  # the smallest object: one boolean
    on: bool


class Point(BaseModel):  # negative integer ranges
    x: Annotated[int, Field(ge=-100, le=100)]
    y: Annotated[int, Field(ge=-100, le=100)]


class Tags(BaseModel):  # an array with a lower bound above 1, strings with a lower bound above 1
    tags: Annotated[list[Word], Field(min_length=2, max_length=4)]


class Matrix(BaseModel):  # arrays of arrays, each bounded
    rows: Annotated[list[Annotated[list[Digit], Field(min_length=1, max_length=3)]],
                    Field(min_length=1, max_length=2)]


class Task(BaseModel):  # an integer enum and a string literal with three values
    title: Word
    priority: Priority
    status: Literal["todo", "doing", "done"]


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: Annotated[int, Field(ge=1, le=9)]


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):  # anyOf of two objects told apart by a literal
    pet: Cat | Dog


class Team(BaseModel):
    name: Short
    size: Annotated[int, Field(ge=1, le=50)]


class Company(BaseModel):  # three levels of nesting, an array of objects
    name: Short
    ceo: Person
    teams: Annotated[list[Team], Field(min_length=1, max_length=2)]


class Scores(BaseModel):  # a nullable array
    scores: Annotated[list[Digit], Field(max_length=3)] | None


class Measurement(BaseModel):  # a bounded number, an enum
    value: Annotated[float, Field(ge=0, le=1)]
    unit: Literal["m", "kg", "s"]


class Ticket(BaseModel):  # patterns, a boolean
    code: Annotated[str, Field(pattern=r"^[A-Z]{3}-[0-9]{2}$")]
    urgent: bool


class Event(BaseModel):  # a date-like pattern, a bounded array, an optional string
    day: Annotated[str, Field(pattern=r"^2026-(0[1-9]|1[0-2])-[0-2][0-9]$")]
    guests: Annotated[list[Short], Field(max_length=2)]
    place: Short | None


class Settings(BaseModel):  # a flat object of many properties
    dark: bool
    volume: Annotated[int, Field(ge=0, le=10)]
    language: Literal["en", "fr", "de"]
    retries: Annotated[int, Field(ge=0, le=3)]
    beta: bool
    theme: Color


class Rgb(BaseModel):  # a tuple (prefixItems) of bounded integers
    rgb: tuple[Annotated[int, Field(ge=0, le=255)], Annotated[int, Field(ge=0, le=255)],
               Annotated[int, Field(ge=0, le=255)]]


class Profile(BaseModel):  # an optional nested object, an optional string, an array of enums
    address: Address | None
    nickname: Word | None
    colors: Annotated[list[Color], Field(max_length=2)]


class Ack(BaseModel):  # a constant, exclusive integer bounds
    status: Literal["ok"]
    code: Annotated[int, Field(gt=199, lt=300)]


SCHEMAS: list[type[BaseModel]] = [Person, Palette, MaybeNote, Inventory, Order, Flag, Point, Tags, Matrix,
                                  Task, Pet, Company, Scores, Measurement, Ticket, Event, Settings, Rgb,
                                  Profile, Ack]
