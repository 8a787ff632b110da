"""Library notices a user of dew_pipe should not see: transformers' "PyTorch was not found".

transformers logs that notice (a warning on its ``transformers`` logger) every time it is
imported without PyTorch. dew_pipe uses transformers only for tokenizers, chat templates and
configuration files, never for its PyTorch models, so on a JAX install the notice is always
printed and never useful. :func:`silence_torch_notice` adds a filter to that one logger which
drops exactly that record; every other transformers message still reaches its handlers, and
``TRANSFORMERS_VERBOSITY`` and the logger's level keep working as documented.

The filter must be in place before transformers is first imported (the notice is logged at
import time), so ``import dew_pipe`` installs it. A Python logger exists before its library
configures it, so installing the filter does not import transformers.

Example:
    >>> import logging
    >>> logger = logging.getLogger("transformers")
    >>> silence_torch_notice()
    >>> any(isinstance(f, TorchNoticeFilter) for f in logger.filters)
    True
    >>> record = logging.LogRecord("transformers", logging.WARNING, __file__, 1,
    ...                            TORCH_NOTICE + " Models won't be available.", None, None)
    >>> TorchNoticeFilter().filter(record)
    False
"""

from __future__ import annotations

import logging

__all__ = ["TORCH_NOTICE", "TorchNoticeFilter", "silence_torch_notice"]

TORCH_NOTICE = "PyTorch was not found."
"""How the notice begins (transformers 4.x and 5.x word it the same way)."""

_LOGGER = "transformers"  # the module-level logger of transformers/__init__.py


class TorchNoticeFilter(logging.Filter):
    """Drops transformers' "PyTorch was not found" record and passes every other one."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        return not message.startswith(TORCH_NOTICE)


def silence_torch_notice() -> None:
    """Install :class:`TorchNoticeFilter` on the ``transformers`` logger (once)."""
    logger = logging.getLogger(_LOGGER)
    if not any(isinstance(f, TorchNoticeFilter) for f in logger.filters):
        logger.addFilter(TorchNoticeFilter())
