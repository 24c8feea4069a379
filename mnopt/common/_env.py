"""Settings read from the environment (MNOPT_*)."""

import os


def whole_number(name, default, minimum, unit=''):
    """The whole number in ``$name`` (at least ``minimum``), or ``default``
    where it is unset or empty; anything else is a ValueError naming it."""
    value = os.environ.get(name, '')
    if value == '':
        return default
    try:
        number = int(value)
        if number < minimum:
            raise ValueError
    except ValueError:
        raise ValueError('%s=%r: a whole number%s >= %d was expected'
                         % (name, value, unit and ' of ' + unit, minimum))
    return number


def flag(name, default):
    """The switch in ``$name``: '1' is on, '0' off, unset or empty the
    ``default``; anything else ('yes', 'true') is a ValueError naming it,
    so a misspelt setting is never silently read as off."""
    value = os.environ.get(name, '')
    if value == '':
        return default
    if value not in ('0', '1'):
        raise ValueError('%s=%r: 1 (on) or 0 (off) was expected'
                         % (name, value))
    return value == '1'


def choice(name, default, choices, any_case=False):
    """The word in ``$name``, one of ``choices`` (lower-cased first if
    ``any_case``); unset or empty is the ``default``; anything else is a
    ValueError naming the choices."""
    value = os.environ.get(name, '')
    if value == '':
        return default
    if any_case and value.lower() in choices:
        return value.lower()
    if value not in choices:
        raise ValueError('%s=%r: one of %s was expected'
                         % (name, value, ', '.join(choices)))
    return value


#: $MNOPT_LOG_LEVEL's values: the level of the 'mnopt' loggers, set
#: without code (INFO: the tuner's and the compression guard's choices,
#: snapshot writes; DEBUG: also each bucket layout).
LOG_LEVELS = ('DEBUG', 'INFO', 'WARNING', 'ERROR')


def log_level():
    """$MNOPT_LOG_LEVEL, upper-cased (``info`` is INFO); None where unset
    or empty; anything else is a ValueError naming the levels."""
    value = os.environ.get('MNOPT_LOG_LEVEL', '')
    if value == '':
        return None
    if value.upper() not in LOG_LEVELS:
        raise ValueError('MNOPT_LOG_LEVEL=%r: one of %s was expected'
                         % (value, ', '.join(LOG_LEVELS)))
    return value.upper()
