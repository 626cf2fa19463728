"""How a data file's bytes arrive: local paths and URLs (http(s) through the standard library's
``http.client``, other protocols through fsspec), byte ranges and whole files, the one retry
policy, each attempt's deadline, the errors of reading (the user's or the machine's), and the
rules a URL read's settings follow (secrets written as ``${VAR}``, attempts bounded by a day).
Plain Python, no torch: the config's checks call it."""
