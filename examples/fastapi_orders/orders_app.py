"""A small FastAPI order service: ``POST /orders`` stores the order and its event
in one transaction, with the async writer.

Settings (read at start-up, not at import):

* ``ORDERS_DB_URL``: an asyncio database URL, e.g.
  ``mysql+asyncmy://app:secret@127.0.0.1:3306/shop`` (``outboxkit[async]``);
* ``ORDERS_TOPIC``: the topic of the ``order-placed`` events (default ``orders``).

Run it with ``uvicorn orders_app:app``. The outbox table must exist
(``outboxkit schema apply``); the order tables are created at start if missing.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from order_tables import metadata, orders
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import outboxkit

#: The largest amount the ``amount_cents`` column (BIGINT) holds. Checked here, so
#: that ``1e20`` or ``2**63`` is a 422 naming the field, not a database error (500).
MAX_AMOUNT_CENTS = 2**63 - 1


class NewOrder(BaseModel):
    customer: str = Field(min_length=1, max_length=64)
    amount_cents: int = Field(gt=0, le=MAX_AMOUNT_CENTS)


class PlacedOrder(BaseModel):
    id: int
    event_id: str


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = create_async_engine(os.environ["ORDERS_DB_URL"], pool_pre_ping=True)
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    app.state.engine = engine
    app.state.topic = os.environ.get("ORDERS_TOPIC", "orders")
    yield
    await engine.dispose()


app = FastAPI(title="orders", lifespan=lifespan)


@app.exception_handler(RequestValidationError)
async def invalid_order(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 with where and why, without echoing the input: FastAPI's own answer
    repeats it, and a number JSON cannot hold (``1e400`` parses as infinity)
    made that answer fail to render (500)."""
    detail = [{k: e[k] for k in ("loc", "msg", "type") if k in e} for e in exc.errors()]
    return JSONResponse(status_code=422, content={"detail": detail})


@app.post("/orders", status_code=201)
async def place_order(order: NewOrder, request: Request) -> PlacedOrder:
    engine: AsyncEngine = request.app.state.engine
    # One transaction: the order row and its event commit together, or neither
    # does. The relay publishes the event only once it is committed.
    async with engine.begin() as conn:
        result = await conn.execute(
            orders.insert().values(customer=order.customer, amount_cents=order.amount_cents)
        )
        order_id = result.lastrowid
        event_id = await outboxkit.enqueue_async(
            conn,
            topic=request.app.state.topic,
            key=order.customer,  # one customer's events stay in order
            payload={
                "type": "order-placed",
                "order_id": order_id,
                "customer": order.customer,
                "amount_cents": order.amount_cents,
            },
        )
    return PlacedOrder(id=order_id, event_id=event_id)
