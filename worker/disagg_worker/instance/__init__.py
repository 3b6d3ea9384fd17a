"""The processes of one engine instance: each rank's scheduler process (`process`), the driver's loop
that receives requests and steps the engine (`loop`), and the ranks that follow the driver (`follower`).
They sit above the engine and the ranks' machinery (`ranks/`), which know nothing of them.
"""
