"""What the request path reports about engines to those who judge them."""

from ._signals import (
    DecodeGaps as DecodeGaps,
    LegObserver as LegObserver,
    RouterLag as RouterLag,
)
