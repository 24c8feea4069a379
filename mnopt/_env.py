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
