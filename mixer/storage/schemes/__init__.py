"""The storage schemes, one module each: the module defines ``BACKEND``, an instance of a
`mixer.storage.backend.Backend` subclass that says all the storage layer knows of its schemes (the
extra it needs, its URL rule, its filesystem, its listing, how its errors are classified, whether it
may be written to). `mixer.storage.registry.SCHEMES` collects every module of this package: a new
scheme is one new module here.
"""
