"""The barrier service: named, generational barriers that release together and never hang."""
